"""A throw-away testbed of network namespaces that look like separate hosts.

``open_testbed(n)`` builds, under a unique name prefix:

- one bridge namespace ``<prefix>br`` holding bridge ``br0`` (no uplink: no
  traffic can leave the machine), multicast snooping off so mDNS floods;
- ``n`` host namespaces ``<prefix>h<i>``, each with ``lo`` and ``eth0``
  (10.<a>.<b>.<i+2>/24, a per-run private subnet) on that bridge and a route
  for 224.0.0.0/4 so multicast stays on it;
- optionally, per host: a ``tc tbf`` rate on both ends of its access link, a
  delay on it (each way; the kernel has no ``netem``, so the link is two TAP
  devices joined by a process that holds every frame: hetmesh/testbed/delay.py),
  and a CPU quota (over a 100 ms period) and/or memory limit, in cgroup v1 or v2
  (hetmesh/testbed/cgroups.py), that processes started with :meth:`NetnsTestbed.popen`
  join before they exec.

Everything is torn down in ``finally``: the processes started through the
testbed are killed by PID, the cgroups removed, the namespaces deleted.
:func:`unavailable_reason` says why a machine cannot run it (not root, no
``ip netns``, a cgroup controller it needs missing), for ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetmesh.testbed.cgroups import CGROUP_ROOT, CPU, detect

NETNS_DIR = Path("/run/netns") if Path("/run/netns").is_dir() else Path("/var/run/netns")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def unavailable_reason(
    *,
    need_cgroups: bool = False,
    need_tc: bool = False,
    cgroup_needs: Sequence[str] = (CPU,),
    cgroup_root: Path = CGROUP_ROOT,
) -> str | None:
    """Why the testbed cannot run here, or None.

    ``need_cgroups``: the controllers in ``cgroup_needs`` (hetmesh/testbed/cgroups.py:
    CPU, MEMORY, MEMORY_PEAK), in cgroup v1 or v2, each checked.
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip netns`)"
    if need_tc and shutil.which("tc") is None:
        return "needs `tc` (iproute2)"
    if need_cgroups:
        hierarchy = detect(cgroup_root)
        if hierarchy is None:
            return f"needs cgroups (v1 or v2) mounted at {cgroup_root}"
        missing = hierarchy.missing(cgroup_needs)
        if missing:
            return missing
        try:
            hierarchy.enable(cgroup_needs)
        except OSError as exc:
            return f"cannot enable cgroup v2 controllers {list(cgroup_needs)}: {exc}"
        if shutil.which("nsenter") is None:
            return "needs nsenter (util-linux): `ip netns exec` hides /sys/fs/cgroup"
    probe = f"hmprobe{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`ip netns add` does not work here: {exc}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _run("ip", "netns", "del", probe)
    return None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a testbed host's processes run: its network namespace and its cgroups.

    What a process must join to be "on" the host; a test's fork server joins them in
    a forked child (hetmesh/testbed/mesh.py's ``spawn``) instead of exec'ing ``nsenter``.
    """

    netns: Path
    cgroups: tuple[Path, ...] = ()


# starts a node's argv (``python -m hetmesh ...``) on a host: (argv, placement, Popen
# kwargs) -> a Popen-like process, or None to leave it to the testbed's own ``popen``
Spawn = Callable[[Sequence[str], Placement, dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class NetnsHost:
    index: int
    namespace: str
    ip: str
    cgroups: tuple[Path, ...] = ()


@dataclass(slots=True)
class NetnsTestbed:
    prefix: str
    bridge_namespace: str
    hosts: list[NetnsHost]
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s network namespace.

        ``nsenter --net`` switches the network namespace only; ``ip netns exec``
        also remounts /sys, which hides /sys/fs/cgroup from the process (so a
        node could not see its own CPU quota). The latter is the fallback.
        """
        namespace = self.hosts[host].namespace
        if shutil.which("nsenter"):
            return ["nsenter", f"--net={NETNS_DIR / namespace}", "--", *argv]
        return ["ip", "netns", "exec", namespace, *argv]

    def placement(self, host: int) -> Placement:
        return Placement(NETNS_DIR / self.hosts[host].namespace, self.hosts[host].cgroups)

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in host ``host``: its namespace and cgroups (joined before exec)."""
        cgroups = self.hosts[host].cgroups

        def join_cgroups() -> None:
            for cg in cgroups:
                (cg / "cgroup.procs").write_text(str(os.getpid()))

        proc = subprocess.Popen(self.argv(host, argv), preexec_fn=join_cgroups, **kwargs)
        self.processes.append(proc)
        return proc


def _delay_link(ns: str, bridge_ns: str, outer: str, delay_s: float) -> subprocess.Popen[Any]:
    """Host namespace ``ns``'s ``eth0`` and the bridge's ``outer``, ``delay_s`` apart."""
    argv = [sys.executable, "-m", "hetmesh.testbed.delay"]
    argv += [str(NETNS_DIR / ns), "eth0", str(NETNS_DIR / bridge_ns), outer, repr(delay_s)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""  # "ready" once both devices exist
    if line.strip() != "ready":
        _kill(proc)
        err = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"the delayed link of {ns} did not come up: {err.strip()[-500:]}")
    return proc


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def open_testbed(
    n: int,
    *,
    rates: Mapping[int, str] | None = None,
    cpu_quota_us: Mapping[int, int] | None = None,
    memory_limit_bytes: Mapping[int, int] | None = None,
    delays_s: Mapping[int, float] | None = None,
) -> Iterator[NetnsTestbed]:
    """Build ``n`` hosts on one bridge (see the module doc); tear it all down after.

    ``delays_s[i]``: seconds every frame waits on host ``i``'s access link, each way;
    two hosts given ``d`` each are ``4 d`` apart in round trip.
    """
    hierarchy = detect(CGROUP_ROOT) if cpu_quota_us or memory_limit_bytes else None
    prefix = f"hm{secrets.token_hex(3)}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    bridge_ns = f"{prefix}br"
    namespaces: list[str] = []
    cgroup_dirs: list[Path] = []
    testbed = NetnsTestbed(prefix=prefix, bridge_namespace=bridge_ns, hosts=[])
    try:
        _run("ip", "netns", "add", bridge_ns)
        namespaces.append(bridge_ns)
        in_br = ("ip", "netns", "exec", bridge_ns)
        _run(*in_br, "ip", "link", "set", "lo", "up")
        _run(*in_br, "ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _run(*in_br, "ip", "link", "set", "br0", "up")
        for i in range(n):
            ns = f"{prefix}h{i}"
            _run("ip", "netns", "add", ns)
            namespaces.append(ns)
            outer = f"{prefix}v{i}"
            ip = f"{subnet}.{i + 2}"
            in_ns = ("ip", "netns", "exec", ns)
            delay_s = (delays_s or {}).get(i)
            if delay_s:
                testbed.processes.append(_delay_link(ns, bridge_ns, outer, delay_s))
            else:
                _run(
                    "ip",
                    "link",
                    "add",
                    outer,
                    "netns",
                    bridge_ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
            _run(*in_br, "ip", "link", "set", outer, "master", "br0")
            _run(*in_br, "ip", "link", "set", outer, "up")
            _run(*in_ns, "ip", "link", "set", "lo", "up")
            _run(*in_ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            _run(*in_ns, "ip", "link", "set", "eth0", "up")
            _run(*in_ns, "ip", "link", "set", "eth0", "multicast", "on")
            _run(*in_ns, "ip", "route", "add", "224.0.0.0/4", "dev", "eth0")
            rate = (rates or {}).get(i)
            if rate:
                tbf = ("root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")
                _run(*in_ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)
                _run(*in_br, "tc", "qdisc", "add", "dev", outer, *tbf)
            cgroups: tuple[Path, ...] = ()
            quota = (cpu_quota_us or {}).get(i)
            mem = (memory_limit_bytes or {}).get(i)
            if quota or mem:
                if hierarchy is None:
                    raise RuntimeError(
                        f"no cgroup hierarchy at {CGROUP_ROOT} for host {i}'s limits"
                    )
                cgroups = hierarchy.create(
                    f"{prefix}h{i}",
                    cgroup_dirs,
                    cpu_quota_us=quota or None,
                    memory_limit_bytes=mem or None,
                )
            testbed.hosts.append(NetnsHost(i, ns, ip, cgroups))
        yield testbed
    finally:
        for proc in testbed.processes:
            _kill(proc)
        for cg in reversed(cgroup_dirs):
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        for ns in reversed(namespaces):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _run("ip", "netns", "del", ns)


__all__ = ["NetnsHost", "NetnsTestbed", "open_testbed", "unavailable_reason"]
