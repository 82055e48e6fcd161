"""Home networks behind NAT routers, emulated with namespaces and nftables.

``open_nat_testbed(homes)`` builds, under a unique name prefix:

- a "WAN" namespace ``<prefix>wan`` holding bridge ``br0``: the shared public
  segment (``10.<a>.<b>.0/24``, a per-run private subnet; no uplink, so no
  traffic leaves the machine);
- one public host ``<prefix>pub`` on that segment (``.2``);
- per home ``i`` a router namespace ``<prefix>r<i>`` with ``wan0`` on the
  segment (``.10+i``) and ``lan0`` (``10.<c>.<i>.1/24``), forwarding on,
  nftables masquerading everything that leaves ``wan0`` and dropping new
  connections from the WAN into the home; and one home host ``<prefix>h<i>``
  (``10.<c>.<i>.2``) whose only route out is that router.

Nothing on the WAN has a route into a home: the public host reaches a home
host only over a connection the home host opened (or a hole punched through
both routers). ``symmetric`` homes masquerade with ``random,fully-random``:
every new connection gets a fresh random port, so the mapping seen by one
destination says nothing about the next (a symmetric NAT, where hole punching
fails). ``rate`` shapes each home's uplink with ``tc tbf`` on both ends.

Processes started with :meth:`NatTestbed.popen` are killed by PID on exit;
the namespaces are deleted (which drops their veths, rules and qdiscs), also
on failure. :func:`nat_unavailable_reason` says why a machine cannot run it.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetmesh.testbed.netns import NETNS_DIR, Placement, _kill, _run, unavailable_reason

# new connections from the WAN never enter a home; replies to what a home host opened do.
# Like most home routers, an unsolicited SYN to the router itself is dropped, not
# answered with a reset (a reset would abort a hole punch's first, early SYN)
_ROUTER_RULES = """
table ip hmnat {{
  chain forward {{
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan0" oifname "wan0" accept
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "wan0" ct state new tcp flags & (syn | ack) == syn drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    oifname "wan0" masquerade{mode}
  }}
}}
"""


def nat_unavailable_reason(*, need_tc: bool = False) -> str | None:
    """Why the NAT testbed cannot run here (for ``pytest.skip``), or None."""
    reason = unavailable_reason(need_tc=need_tc)
    if reason:
        return reason
    if shutil.which("nft") is None:
        return "needs nftables (`nft`; scripts/bootstrap installs it)"
    return None


@dataclass(frozen=True, slots=True)
class NatHost:
    """One host: its namespace, its own address, and the address the WAN sees it by."""

    name: str
    namespace: str
    ip: str
    public_ip: str  # its own for the public host; its router's WAN address for a home host
    behind_nat: bool


@dataclass(slots=True)
class NatTestbed:
    prefix: str
    wan_namespace: str
    public: NatHost
    homes: list[NatHost]
    routers: list[str]  # router namespaces, by home
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def hosts(self) -> list[NatHost]:
        """The public host first, then the home hosts in order."""
        return [self.public, *self.homes]

    def argv(self, host: NatHost, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s network namespace (``nsenter`` keeps /sys)."""
        if shutil.which("nsenter"):
            return ["nsenter", f"--net={NETNS_DIR / host.namespace}", "--", *argv]
        return ["ip", "netns", "exec", host.namespace, *argv]

    def placement(self, host: NatHost) -> Placement:
        return Placement(NETNS_DIR / host.namespace)

    def popen(self, host: NatHost, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace; killed by PID when the testbed closes."""
        proc = subprocess.Popen(self.argv(host, argv), **kwargs)
        self.processes.append(proc)
        return proc


# A one-shot TCP listener: prints its port, then the address of whoever connected
_LISTEN = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], 0)); s.settimeout(float(sys.argv[2]))\n"
    "print(s.getsockname()[1], flush=True)\n"
    "try:\n"
    "    c, peer = s.accept()\n"
    "except TimeoutError:\n"
    "    print('none', flush=True)\n"
    "else:\n"
    "    print(peer[0], flush=True); c.close()\n"
)
_DIAL = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "except OSError as exc:\n"
    "    print('fail', type(exc).__name__, flush=True)\n"
    "else:\n"
    "    print('ok', flush=True)\n"
)


def try_dial(bed: NatTestbed, src: NatHost, dst: NatHost, *, timeout_s: float = 3.0) -> str | None:
    """Open a TCP connection from ``src`` to ``dst``'s own address.

    Returns the source address ``dst`` saw (``src.public_ip`` through a NAT), or
    None when the connection could not be made within ``timeout_s``.
    """
    listener = bed.popen(
        dst,
        [sys.executable, "-c", _LISTEN, dst.ip, str(timeout_s + 5)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout is not None
    port = listener.stdout.readline().strip()
    dial = subprocess.run(
        bed.argv(src, [sys.executable, "-c", _DIAL, dst.ip, port, str(timeout_s)]),
        capture_output=True,
        text=True,
        timeout=timeout_s + 30,
    )
    if dial.stdout.strip() != "ok":
        _kill(listener)
        return None
    seen = listener.stdout.readline().strip()
    listener.wait(timeout=timeout_s + 30)
    return None if seen in ("", "none") else seen


# Two UDP ports on one socket each: prints both ports, then "ip:port" of the first
# datagram on each (the sender's address after its router's mapping)
_UDP_ECHO = (
    "import socket, sys\n"
    "socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]\n"
    "for s in socks: s.bind((sys.argv[1], 0)); s.settimeout(float(sys.argv[2]))\n"
    "print(*(s.getsockname()[1] for s in socks), flush=True)\n"
    "for s in socks:\n"
    "    try: _, peer = s.recvfrom(64)\n"
    "    except TimeoutError: peer = ('none', 0)\n"
    "    print(f'{peer[0]}:{peer[1]}', flush=True)\n"
)
# One UDP socket sends a datagram to each of the given ports, a few times (UDP may drop)
_UDP_SEND = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 0))\n"
    "for _ in range(5):\n"
    "    for port in sys.argv[2:]: s.sendto(b'x', (sys.argv[1], int(port)))\n"
    "    time.sleep(0.05)\n"
)


def udp_mappings(bed: NatTestbed, src: NatHost, dst: NatHost) -> tuple[str, str]:
    """The ``ip:port`` ``dst`` sees for one UDP socket of ``src`` sending to two of its ports.

    Equal through a cone NAT (one mapping per socket), different through a
    symmetric one (a mapping per destination): what decides whether a hole
    punched towards one peer is usable by another.
    """
    echo = bed.popen(
        dst, [sys.executable, "-c", _UDP_ECHO, dst.ip, "20"], stdout=subprocess.PIPE, text=True
    )
    assert echo.stdout is not None
    ports = echo.stdout.readline().split()
    subprocess.run(
        bed.argv(src, [sys.executable, "-c", _UDP_SEND, dst.ip, *ports]),
        check=True,
        capture_output=True,
        timeout=60,
    )
    first, second = echo.stdout.readline().strip(), echo.stdout.readline().strip()
    echo.wait(timeout=60)
    return first, second


# One side of a hole punch (hetmesh.nat.punch) from a fixed local port: says
# "ready" once imported, reads the shared start (a CLOCK_MONOTONIC time) on stdin,
# punches, then sends (or receives) the given bytes and prints one JSON line
_PUNCH = """
import json, socket, sys, time
from hetmesh.nat.punch import simultaneous_open
from hetmesh.nat.punch_plan import AttemptSchedule, Candidate
local_ip, local_port, remote_ip, remote_port, role, nbytes = sys.argv[1:7]
nbytes = int(nbytes)
print("ready", flush=True)
start = float(sys.stdin.readline())
schedule = AttemptSchedule()
sock = simultaneous_open(
    (local_ip, int(local_port)), Candidate(remote_ip, int(remote_port)), schedule, clock=start
)
if sock is None:
    print(json.dumps({"ok": False}), flush=True)
    sys.exit(0)
result = {"ok": True, "local": sock.getsockname()[1], "peer": list(sock.getpeername())}
sock.settimeout(120)
chunk = bytearray(1 << 20)
if role == "send":
    t0 = time.monotonic()
    left = nbytes
    while left > 0:
        left -= sock.send(memoryview(chunk)[: min(left, len(chunk))])
    sock.recv(1)  # the receiver's acknowledgement: everything arrived
    result["seconds"] = time.monotonic() - t0
else:
    got = 0
    while got < nbytes:
        n = sock.recv_into(chunk)
        if not n:
            break
        got += n
    result["received"] = got
    sock.sendall(b"k")
sock.close()
print(json.dumps(result), flush=True)
"""


def try_punch(
    bed: NatTestbed,
    a: NatHost,
    b: NatHost,
    *,
    port: int,
    nbytes: int = 0,
    timeout_s: float = 90.0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both home hosts punch from local ``port`` to the other's router at that port at
    once (the candidate a port-preserving router gives); ``a`` then sends ``nbytes`` to
    ``b``. Returns each side's JSON report (``ok``, ``peer``, and ``seconds`` on ``a``)."""
    import json
    import time

    procs = [
        bed.popen(
            host,
            [
                sys.executable,
                "-c",
                _PUNCH,
                host.ip,
                str(port),
                other.public_ip,
                str(port),
                role,
                str(nbytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for host, other, role in ((a, b, "send"), (b, a, "receive"))
    ]
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a punch helper did not start")
    start = time.monotonic() + 0.3  # one clock for both namespaces' processes
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start}\n")
        proc.stdin.flush()
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout_s)
        lines = [x for x in out.splitlines() if x.startswith("{")]
        reports.append(json.loads(lines[-1]) if lines else {"ok": False, "error": out[-500:]})
    return reports[0], reports[1]


@contextlib.contextmanager
def open_nat_testbed(
    homes: int = 2,
    *,
    symmetric: Collection[int] = (),
    rate: str | None = None,
) -> Iterator[NatTestbed]:
    """Build a public host and ``homes`` NATed homes (see the module doc); tear down after."""
    prefix = f"hn{secrets.token_hex(3)}"
    wan = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    lan_base = f"10.{150 + secrets.randbelow(50)}"
    wan_ns = f"{prefix}wan"
    namespaces: list[str] = []
    processes: list[subprocess.Popen[Any]] = []
    try:
        _run("ip", "netns", "add", wan_ns)
        namespaces.append(wan_ns)
        in_wan = ("ip", "netns", "exec", wan_ns)
        _run(*in_wan, "ip", "link", "set", "lo", "up")
        _run(*in_wan, "ip", "link", "add", "br0", "type", "bridge")
        _run(*in_wan, "ip", "link", "set", "br0", "up")

        def plug(ns: str, port: str, ifname: str, ip: str) -> None:
            # a veth from namespace ``ns`` (``ifname``) to the WAN bridge (``port``)
            _run(
                "ip",
                "link",
                "add",
                port,
                "netns",
                wan_ns,
                "type",
                "veth",
                "peer",
                "name",
                ifname,
                "netns",
                ns,
            )
            _run(*in_wan, "ip", "link", "set", port, "master", "br0")
            _run(*in_wan, "ip", "link", "set", port, "up")
            in_ns = ("ip", "netns", "exec", ns)
            _run(*in_ns, "ip", "link", "set", "lo", "up")
            _run(*in_ns, "ip", "addr", "add", f"{ip}/24", "dev", ifname)
            _run(*in_ns, "ip", "link", "set", ifname, "up")

        pub_ns = f"{prefix}pub"
        _run("ip", "netns", "add", pub_ns)
        namespaces.append(pub_ns)
        plug(pub_ns, f"{prefix}vp", "eth0", f"{wan}.2")
        public = NatHost("public", pub_ns, f"{wan}.2", f"{wan}.2", behind_nat=False)

        home_hosts: list[NatHost] = []
        routers: list[str] = []
        for i in range(homes):
            router, host = f"{prefix}r{i}", f"{prefix}h{i}"
            for ns in (router, host):
                _run("ip", "netns", "add", ns)
                namespaces.append(ns)
            router_wan = f"{wan}.{10 + i}"
            plug(router, f"{prefix}vr{i}", "wan0", router_wan)
            in_router = ("ip", "netns", "exec", router)
            in_host = ("ip", "netns", "exec", host)
            _run(
                "ip",
                "link",
                "add",
                "lan0",
                "netns",
                router,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host,
            )
            _run(*in_router, "ip", "addr", "add", f"{lan_base}.{i}.1/24", "dev", "lan0")
            _run(*in_router, "ip", "link", "set", "lan0", "up")
            _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            mode = " random,fully-random" if i in symmetric else ""
            subprocess.run(
                [*in_router, "nft", "-f", "-"],
                input=_ROUTER_RULES.format(mode=mode),
                text=True,
                check=True,
                capture_output=True,
                timeout=20,
            )
            _run(*in_host, "ip", "link", "set", "lo", "up")
            _run(*in_host, "ip", "addr", "add", f"{lan_base}.{i}.2/24", "dev", "eth0")
            _run(*in_host, "ip", "link", "set", "eth0", "up")
            _run(*in_host, "ip", "route", "add", "default", "via", f"{lan_base}.{i}.1")
            if rate:
                tbf = ("root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")
                _run(*in_router, "tc", "qdisc", "add", "dev", "wan0", *tbf)
                _run(*in_wan, "tc", "qdisc", "add", "dev", f"{prefix}vr{i}", *tbf)
            routers.append(router)
            home_hosts.append(
                NatHost(f"home{i}", host, f"{lan_base}.{i}.2", router_wan, behind_nat=True)
            )
        bed = NatTestbed(prefix, wan_ns, public, home_hosts, routers, processes)
        yield bed
    finally:
        for proc in processes:
            _kill(proc)
        for ns in reversed(namespaces):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _run("ip", "netns", "del", ns)


__all__ = [
    "NatHost",
    "NatTestbed",
    "nat_unavailable_reason",
    "open_nat_testbed",
    "try_dial",
    "try_punch",
    "udp_mappings",
]
