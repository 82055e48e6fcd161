"""Control-plane scale: the membership protocol simulated, and real idle meshes.

    python bench/scale.py --json                       # both parts
    python bench/scale.py --json --part sim --sim-sizes 100 1000
    python bench/scale.py --json --part sim --sim-sizes 10000    # ~2 GB, minutes
    python bench/scale.py --json --part real --real-sizes 4 8 16 --baseline-src /work/main

**Simulation** (``--part sim``): the node's own membership code
(:class:`hetmesh.discovery.membership.Membership`) on a virtual network
(:class:`hetmesh.discovery.simnet.SimNet`): virtual time, 1-5 ms latency,
``--loss`` of every message lost (1 % by default). Each size starts from a
converged mesh (every node adopts one shared member table copy-on-write and
copies only the entries it touches, so 10,000 nodes fit in a few GB), then
measures, in this order:

* steady state over ``--window-s``: messages and bytes (the real msgpack
  encoding) sent per node per second;
* a join through one bootstrap peer: protocol periods until every node holds
  the newcomer as alive, and until every node holds its record;
* two crashed (they refuse connections) and two frozen (silent) nodes:
  seconds until the first and until the last live node declares each dead;
* false verdicts over the whole run: suspicions and deaths of healthy nodes.

**Real processes** (``--part real``): N ``hetmesh node start --no-serve``
processes on loopback, bootstrapped from the first: seconds from launch (and
from the last node being ready) until every node sees all others alive (every
node's view asked once a second through one watcher host that dials each node
once), then
idle CPU per node (``/proc``, over ``--idle-s``) and bytes sent per node per
second (the node's own counter; absent in a baseline without it) with what
they were (messages, the node's own record versions and records pulled, per
node per second), the
machine's load average when the size started, and false deaths: death
verdicts the nodes reached (their ``deaths`` counter) although no node was
stopped, with the late ticks that show how starved they were. Each node
starts with this machine's CPU benchmark, measured once by the bench (as a
restarted node, and the test suite's nodes, have it); ``--fresh-profiles``
makes every node measure its own (a first start). The last key, ``targets``,
holds the issue's two targets and the false deaths per size. With
``--baseline-src DIR`` the same sizes run again with ``DIR`` first on
``PYTHONPATH`` (e.g. the main checkout: the full-record-every-second path).
This machine is shared: real-process figures are as measured, not ideal.

The node runs the membership core (``discovery/service.py``); a checkout
from before that (``--baseline-src``) sends its whole record to every peer
every second. A size whose nodes do not all start within ``--start-timeout-s``
is reported with its error instead of ending the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetmesh.discovery.simnet import SimNet
from hetmesh.discovery.table import Health

REPO = Path(__file__).resolve().parents[1]

SECRET = "bench-scale-secret"


# -- simulation ------------------------------------------------------------------------


def simulate(n: int, *, loss: float, window_s: float, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    net = SimNet(seed=seed, loss=loss)
    ids = [f"p{i:05d}" for i in range(n)]
    for peer in ids:
        net.add_node(peer)
    net.prefill(ids)
    period = net.policy.interval_s
    net.run_until(5.0)  # let the probe rounds settle into their rhythm
    healthy = set(ids)

    # steady state
    m0, b0 = net.stats.messages, net.stats.bytes
    t0 = net.now
    net.run_until(t0 + window_s)
    per_node_msgs = (net.stats.messages - m0) / n / window_s
    per_node_bytes = (net.stats.bytes - b0) / n / window_s

    # a join through one bootstrap peer
    joiner = "joiner"
    t_join = net.now
    net.add_node(joiner, introduce_to=ids[0])
    alive_at = records_at = None
    while net.now - t_join < 120 and records_at is None:
        net.run_until(net.now + period / 2)
        if alive_at is None and all(net.health(p, joiner) == "alive" for p in ids):
            alive_at = net.now - t_join
        if alive_at is not None and all(
            (e := net.nodes[p].entries.get(joiner)) is not None and e.record is not None
            for p in ids
        ):
            records_at = net.now - t_join
    healthy.add(joiner)

    # faults
    crashed, frozen = ids[1:3], ids[3:5]
    t_fault = net.now
    for p in crashed:
        net.crash(p)
    for p in frozen:
        net.freeze(p)
    faulty = set(crashed) | set(frozen)
    healthy -= faulty
    # who has each faulty node as a live member (the newcomer may not know them all yet)
    observers = {
        f: {p for p in healthy if net.health(p, f) in ("alive", "suspect", "joining")}
        for f in faulty
    }
    first: dict[str, float] = {}
    every: dict[str, set[str]] = {p: set() for p in faulty}
    last: dict[str, float] = {}

    def on_verdict(v: Any) -> None:
        peer = v.event.peer_id
        if peer in faulty and v.event.new is Health.DEAD and v.observer in observers[peer]:
            first.setdefault(peer, v.at_s - t_fault)
            every[peer].add(v.observer)
            if len(every[peer]) == len(observers[peer]):
                last.setdefault(peer, v.at_s - t_fault)

    net.on_verdict = on_verdict
    net.run_until(t_fault + 20.0)
    false_suspect = sum(
        1 for v in net.verdicts if v.event.peer_id in healthy and v.event.new is Health.SUSPECT
    )
    false_dead = sum(
        1 for v in net.verdicts if v.event.peer_id in healthy and v.event.new is Health.DEAD
    )

    def worst(d: dict[str, float], peers: list[str]) -> float | None:
        vals = [d.get(p) for p in peers]
        return None if any(v is None for v in vals) else round(max(v for v in vals if v), 2)

    return {
        "nodes": n,
        "loss": loss,
        "fanout": net.policy.fanout(n - 1),
        "msgs_per_node_s": round(per_node_msgs, 2),
        "bytes_per_node_s": round(per_node_bytes, 1),
        "join_rounds_all_alive": None if alive_at is None else round(alive_at / period, 1),
        "join_rounds_all_records": None if records_at is None else round(records_at / period, 1),
        "crash_first_dead_s": worst(first, crashed),
        "crash_all_dead_s": worst(last, crashed),
        "freeze_first_dead_s": worst(first, frozen),
        "freeze_all_dead_s": worst(last, frozen),
        "false_suspicions": false_suspect,
        "false_dead": false_dead,
        "virtual_s": round(net.now, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }


# -- real processes ------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _views(host: Any, addrs: list[str]) -> list[dict[str, Any] | None]:
    """Every node's view, asked at once through the watcher's one host."""
    import trio

    from hetmesh.discovery.status import request_status

    out: list[dict[str, Any] | None] = [None] * len(addrs)

    async def one(i: int) -> None:
        with contextlib.suppress(Exception):
            out[i] = await request_status(host, addrs[i], timeout_s=10.0, dial_timeout_s=10.0)

    async with trio.open_nursery() as nursery:
        for i in range(len(addrs)):
            nursery.start_soon(one, i)
    return out


def _sees_all(view: dict[str, Any] | None, ids: set[str]) -> bool:
    if view is None:
        return False
    health = {p["peer_id"]: p["health"] for p in view["peers"]}
    return all(health.get(i) == "alive" for i in ids - {view["self"]})


async def _watch(
    addrs: list[str], ids: set[str], pids: list[int], ready: float, timeout_s: float, idle_s: float
) -> tuple[float | None, list[Any], list[Any], list[float], list[float], float]:
    """Poll every node's view (once a second, one host dialling each node once: a
    fresh host per poll would cost every node a handshake a second) until all see
    all alive; then idle CPU and the nodes' sent-byte counters over ``idle_s``."""
    import trio

    from hetmesh.discovery.status import open_status_client

    # generous limits: on a loaded machine a node negotiates a stream in seconds, and a
    # view that times out would read as "not converged"
    async with open_status_client(mesh_secret=SECRET, dial_timeout_s=10.0) as host:
        converged = None
        while time.monotonic() - ready < timeout_s:
            views = await _views(host, addrs)
            if all(_sees_all(v, ids) for v in views):
                converged = time.monotonic()
                break
            await trio.sleep(1.0)
        await trio.sleep(5.0)  # let the link probes that follow a join finish
        before = await _views(host, addrs)
        cpu0 = [_cpu_s(p) for p in pids]
        t0 = time.monotonic()
        await trio.sleep(idle_s)
        cpu1 = [_cpu_s(p) for p in pids]
        elapsed = time.monotonic() - t0
        after = await _views(host, addrs)
    return converged, before, after, cpu0, cpu1, elapsed


def real_mesh_or_error(n: int, **kw: Any) -> dict[str, Any]:
    """:func:`real_mesh`, or the reason it could not run (a loaded machine may not
    start N processes in time)."""
    try:
        return real_mesh(n, **kw)
    except RuntimeError as exc:
        return {"nodes": n, "src": str(kw["src"]), "error": str(exc)[:300]}


def _machine_benchmark() -> str:
    """This machine's CPU benchmark cache file, measured once (as a restarted node has it)."""
    from hetmesh.discovery.profiling import CACHE_FILE, benchmark_cpu

    with tempfile.TemporaryDirectory() as folder:
        benchmark_cpu(Path(folder))
        return (Path(folder) / CACHE_FILE).read_text()


def real_mesh(
    n: int,
    *,
    src: Path,
    idle_s: float,
    timeout_s: float,
    start_timeout_s: float,
    benchmark: str | None = None,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"hetmesh-scale-{n}-"))
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    env.pop("HETMESH_MESH_SECRET", None)
    procs: list[subprocess.Popen[bytes]] = []
    infos: list[dict[str, Any]] = []

    def start(i: int, bootstrap: str | None) -> None:
        data = root / f"n{i}"
        data.mkdir()
        if benchmark is not None:  # the machine's figures: no CPU benchmark at start
            from hetmesh.discovery.profiling import CACHE_FILE

            (data / CACHE_FILE).write_text(benchmark)
        argv = [sys.executable, "-m", "hetmesh", "node", "start", "--no-serve"]
        argv += ["--data-dir", str(data), "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0"]
        argv += ["--mesh-secret", SECRET]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        with (root / f"n{i}.log").open("ab") as log:
            procs.append(
                subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src)
            )

    def wait_info(i: int) -> dict[str, Any]:
        path = root / f"n{i}" / "node.json"
        deadline = time.monotonic() + start_timeout_s
        while not path.exists():
            if procs[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {i} did not start: {(root / f'n{i}.log').read_text()}")
            time.sleep(0.2)
        info: dict[str, Any] = json.loads(path.read_text())
        return info

    try:
        load_at_start = os.getloadavg()[0]
        launched = time.monotonic()
        start(0, None)
        infos.append(wait_info(0))
        first = infos[0]["addrs"][0]
        for i in range(1, n):
            start(i, first)
        infos += [wait_info(i) for i in range(1, n)]
        ready = time.monotonic()
        ids = {str(info["peer_id"]) for info in infos}
        addrs = [str(info["addrs"][0]) for info in infos]
        pids = [p.pid for p in procs]
        import trio

        converged, before, after, cpu0, cpu1, elapsed = trio.run(
            _watch, addrs, ids, pids, ready, timeout_s, idle_s
        )
        sent = []
        for b, a in zip(before, after, strict=True):
            if b and a and "bytes_sent" in a["statistics"]:
                sent.append(a["statistics"]["bytes_sent"] - b["statistics"]["bytes_sent"])
        cores = [(c1 - c0) / elapsed for c0, c1 in zip(cpu0, cpu1, strict=True)]

        def rate(name: str) -> float | None:
            """A node counter's mean increase per node per second over the idle window."""
            pairs = [(b, a) for b, a in zip(before, after, strict=True) if b and a]
            if not pairs or any(name not in a["statistics"] for _, a in pairs):
                return None
            total = sum(a["statistics"][name] - b["statistics"][name] for b, a in pairs)
            return round(total / len(pairs) / elapsed, 3)

        stats = [v["statistics"] for v in after if v is not None]
        # nobody was stopped: every death verdict is a false one (None: a baseline
        # without the counter)
        counted = bool(stats) and all("deaths" in st for st in stats)
        return {
            "nodes": n,
            "src": str(src),
            "fresh_profiles": benchmark is None,
            "converged_s_from_launch": None
            if converged is None
            else round(converged - launched, 1),
            "converged_s_from_ready": None if converged is None else round(converged - ready, 1),
            "idle_cores_per_node": round(sum(cores) / n, 4),
            "idle_cores_mesh": round(sum(cores), 3),
            "bytes_sent_per_node_s": round(sum(sent) / len(sent) / elapsed) if sent else None,
            "idle_window_s": round(elapsed, 1),
            # what the bytes were: messages, own record versions, records pulled
            "messages_per_node_s": rate("announcements_sent"),
            "records_published_per_node_s": rate("records_published"),
            "pulls_per_node_s": rate("pulls"),
            "load_average_at_start": round(load_at_start, 1),
            "false_deaths": sum(st["deaths"] for st in stats) if counted else None,
            "late_ticks": sum(st["late_ticks"] for st in stats) if counted else None,
            "max_local_health": max(st["local_health"] for st in stats) if counted else None,
        }
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--part", choices=["sim", "real", "both"], default="both")
    ap.add_argument("--sim-sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--real-sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="to converge, from ready")
    ap.add_argument(
        "--fresh-profiles",
        action="store_true",
        help="every node runs its own CPU benchmark (a first start on this machine); "
        "by default each starts with the machine's figures, measured once, as a "
        "restarted node (and the test suite's nodes) do",
    )
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--baseline-src", type=Path, default=None)
    args = ap.parse_args()

    out: dict[str, Any] = {}
    if args.part in ("sim", "both"):
        sims = [
            simulate(n, loss=args.loss, window_s=args.window_s, seed=args.seed)
            for n in args.sim_sizes
        ]
        out["simulation"] = sims
        by_n = {s["nodes"]: s for s in sims}
        if 100 in by_n and 1000 in by_n:
            out["per_node_bytes_growth_1000_vs_100"] = round(
                by_n[1000]["bytes_per_node_s"] / by_n[100]["bytes_per_node_s"], 3
            )
        out["sim_crash_all_dead_s_max"] = max((s["crash_all_dead_s"] or 1e9) for s in sims)
        out["sim_false_dead"] = sum(s["false_dead"] for s in sims)
    if args.part in ("real", "both"):
        kw = {
            "idle_s": args.idle_s,
            "timeout_s": args.timeout_s,
            "start_timeout_s": args.start_timeout_s,
            "benchmark": None if args.fresh_profiles else _machine_benchmark(),
        }
        out["load_average_before"] = os.getloadavg()
        real = [real_mesh_or_error(n, src=REPO, **kw) for n in args.real_sizes]
        out["real"] = real
        for r in real:
            out[f"converged_s_{r['nodes']}"] = r.get("converged_s_from_launch")
            out[f"converged_s_from_ready_{r['nodes']}"] = r.get("converged_s_from_ready")
            out[f"idle_cores_per_node_{r['nodes']}"] = r.get("idle_cores_per_node")
            out[f"false_deaths_{r['nodes']}"] = r.get("false_deaths")
        if args.baseline_src is not None:
            out["baseline"] = [
                real_mesh_or_error(n, src=args.baseline_src, **kw) for n in args.real_sizes
            ]
        out["load_average_after"] = os.getloadavg()
        out["targets"] = {
            "idle_cores_per_node_16 <= 0.02": out.get("idle_cores_per_node_16"),
            "converged_s_16 <= 20": out.get("converged_s_16"),
            "false_deaths": {r["nodes"]: r.get("false_deaths") for r in real},
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
