"""A model no host can hold, served by testbed hosts that each hold a part (root, Linux).

``python bench/bigmodel.py [--json]`` builds ``--hosts`` emulated hosts (network
namespaces, a cgroup v1/v2 memory limit of ``--memory-limit`` each, one torch thread
each; ``hetmesh/testbed/mesh.py``), starts ``hetmesh node start --model MODEL
--weights int4`` on every one, waits until the plan is served and generates
``--tokens`` greedy tokens of a short prompt. With ``--standby`` (default on) one more
host joins, the planner keeps it as a standby replica of a stage (``--standby 0``: none).

Each node offers the planner its limit less ``--runtime-headroom`` (``--max-memory``):
the planner charges a stage's weights, KV, workspace and a reserve (the larger of 64 MiB
and 5 % of the offer), not the node process itself (~335 MiB with ``--block-step-ms``:
Python, torch, transformers, libp2p; more after a calibration), so a node offering its
whole limit is given stages it cannot hold with its runtime and is OOM-killed. The
defaults, three 2 GiB hosts offering 1748 MiB each, hold the 8B shape's 4625 MiB of
stages in three (docs/journal/2026-12-05-bigmodel2.md); a calibrating node needs more
headroom than that. The loader reads the file past the page cache (``O_DIRECT``,
``checkpoint.read_direct``; where refused, it drops the pages it read), so a cgroup's
peak is the node's own memory.

Keys (``--json`` prints one object):

- ``placed_stages``: stages of the adopted plan's primary pipeline (target ≥ 3);
- ``outputs_identical``: the mesh's tokens equal those of one process holding the whole
  model in int4 (``LocalPipeline``, run in this process after the mesh is gone);
- ``rss_over_planned_max``: max over hosts of the cgroup's peak memory
  (``memory.max_usage_in_bytes`` / ``memory.peak``: every byte charged to the group,
  page cache included) ÷ the ``memory_bytes`` the planner charged its stages (≤ 1.15);
- ``start_to_serving_over_disk_read``: max over stage hosts of (node process started →
  its stage ready, by the "stage [a, b) ready" line of its own log) ÷ the time to read
  that stage's tensor bytes from the model file, read in this run after dropping the
  file's cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``, "cold-ish": the device's
  own cache stays) (target ≤ 2). The hosts start together: the first (the others'
  bootstrap peer), then the others as soon as it listens (its start → serving holds
  the wait for them). ``load_over_disk_read`` splits out the stage load itself (plan
  adopted → ready, by the status poll), as start-to-serving also holds the process's
  start, profiling and the wait for the other hosts and the plan; each stage host's
  ``phases`` split it by its log (:func:`start_phases`: imports, up and profiled,
  waiting for the plan, load). The testbed's hosts share one disk:
  ``all_stages_disk_read_together_s`` reads every stage of the plan at once, what
  loads started together compete for;
- ``failover_outputs_identical`` (with a standby): a stage host whose stage the standby
  backs up is SIGKILLed after ``--kill-after`` tokens of a stream; the stream's tokens
  equal the reference's.

``--model synth-llama-3.2-1b --memory-limit 640MiB`` runs the same on the 1B shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PROMPT = "The lighthouse keeper climbed the stairs"
NODE_ARGS = ("--max-sessions", "1", "--max-context", "128", "--weights", "int4")
READ_CHUNK = 16 << 20


# -- pure helpers (tests/unit/bench/test_bigmodel.py) ----------------------------------


def unit_prefixes(start: int, end: int, num_layers: int, *, tied: bool = False) -> tuple[str, ...]:
    """The checkpoint name prefixes of units ``[start, end)`` (see partition/profile.py:
    unit 0 the embedding, ``1..L`` the decoder layers, ``L + 1`` the final norm and head;
    a ``tied`` head reads the embedding's matrix)."""
    out: list[str] = []
    if start == 0:
        out.append("model.embed_tokens.")
    out += [f"model.layers.{u - 1}." for u in range(max(start, 1), min(end, num_layers + 1))]
    if end == num_layers + 2:
        out += ["model.norm.", "lm_head."]
        if tied and start > 0:
            out.append("model.embed_tokens.")
    return tuple(out)


def stage_spans(
    header: dict[str, Any], data_start: int, prefixes: Sequence[str]
) -> list[tuple[int, int]]:
    """File byte ranges ``(offset, length)`` of the tensors whose names start with one of
    ``prefixes`` in a safetensors ``header`` (adjacent ranges merged), sorted."""
    spans = sorted(
        (data_start + int(v["data_offsets"][0]), data_start + int(v["data_offsets"][1]))
        for k, v in header.items()
        if k != "__metadata__" and k.startswith(tuple(prefixes))
    )
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return [(a, b - a) for a, b in merged]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", re.M)


def log_stamp(node_log: str, pattern: str) -> float | None:
    """The epoch time of the first line of ``node_log`` holding ``pattern`` (the node's
    logging writes local time, to the millisecond; None: no such line)."""
    for line in node_log.splitlines():
        found = _STAMP.match(line)
        if found and pattern in line:
            whole = time.mktime(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S"))
            return whole + int(found.group(2)) / 1000
    return None


def listening_addr(node_log: str) -> str | None:
    """The first address a node's log says it listens on (None: not yet)."""
    found = re.search(r" listening on (\S+/p2p/\S+)", node_log)
    return found.group(1) if found else None


def start_phases(node_log: str, started_epoch: float, start: int, end: int) -> dict[str, float]:
    """Split a stage host's start → serving by its log's timestamps (local time, as the
    node's logging writes them): ``imports_s`` process start → its first log line
    (Python, torch, transformers, libp2p imports, the model's resolution);
    ``up_profile_s`` → "profiled" (the host listening, joining, the CPU profile);
    ``wait_plan_s`` → "loading units [start, end)" (waiting for the other hosts, the
    calibration or its skip, the plan); ``load_s`` → "stage [start, end) ready". A
    phase whose marks are missing is left out."""

    def at(pattern: str) -> float | None:
        return log_stamp(node_log, pattern)

    marks = [
        ("imports_s", started_epoch),
        ("up_profile_s", at(" INFO ")),
        ("wait_plan_s", at("profiled:")),
        ("load_s", at(f"loading units [{start}, {end})")),
        ("", at(f"stage [{start}, {end}) ready")),
    ]
    out: dict[str, float] = {}
    for (name, begin), (_, finish) in itertools.pairwise(marks):
        if begin is not None and finish is not None:
            out[name] = round(finish - begin, 2)
    return out


def ratio_max(pairs: Iterable[tuple[float, float]]) -> float:
    """max of numerator ÷ denominator over ``pairs`` (rounded to 3 places)."""
    return round(max(n / d for n, d in pairs), 3)


# -- disk ------------------------------------------------------------------------------


def drop_cached(file: Path) -> None:
    """Drop ``file``'s pages from the page cache (those no process maps)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_spans(fd: int, file: Path, spans: Sequence[tuple[int, int]]) -> None:
    for offset, length in spans:
        done = 0
        while done < length:
            got = os.pread(fd, min(READ_CHUNK, length - done), offset + done)
            if not got:
                raise OSError(f"{file}: short read at {offset + done}")
            done += len(got)


def read_cold(file: Path, spans: Sequence[tuple[int, int]]) -> float:
    """Seconds to read ``spans`` of ``file`` after dropping its cached pages."""
    drop_cached(file)
    fd = os.open(file, os.O_RDONLY)
    try:
        began = time.monotonic()
        _read_spans(fd, file, spans)
        return time.monotonic() - began
    finally:
        os.close(fd)


def read_cold_together(file: Path, stages: Sequence[Sequence[tuple[int, int]]]) -> float:
    """Seconds to read every stage's ``spans`` of ``file`` at once, one thread a stage,
    after dropping its cached pages: what the testbed's hosts, which share this machine's
    one disk, read together when they load at the same time."""
    drop_cached(file)
    fd = os.open(file, os.O_RDONLY)
    failed: list[OSError] = []

    def read(spans: Sequence[tuple[int, int]]) -> None:
        try:
            _read_spans(fd, file, spans)
        except OSError as exc:
            failed.append(exc)

    try:
        threads = [threading.Thread(target=read, args=(spans,)) for spans in stages]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        return time.monotonic() - began
    finally:
        os.close(fd)


# -- a streaming client, run inside a host (``--stream-client``) ------------------------


async def _stream(addr: str, secret: str, ids: list[int], n: int) -> None:
    from hetmesh.client.mesh import Finished, TokenEvent, open_mesh_client
    from hetmesh.errors import MeshError

    try:
        async with open_mesh_client(addr, mesh_secret=secret, timeout_s=600.0) as mesh:
            async for event in mesh.stream(prompt_ids=ids, max_new_tokens=n):
                if isinstance(event, TokenEvent) and event.token_id >= 0:
                    print(json.dumps({"token": event.token_id}), flush=True)
                elif isinstance(event, Finished):
                    print(json.dumps({"finish": event.finish_reason}), flush=True)
    except MeshError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)


# -- the run ---------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ready_stages(view: dict[str, Any]) -> set[tuple[str, int, int]]:
    return {
        (str(p["peer_id"]), int(st["start"]), int(st["end"]))
        for p in view.get("peers", [])
        for st in (p.get("record") or {}).get("stages") or ()
        if st.get("ready")
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hetmesh.partition.checkpoint import read_safetensors_header
    from hetmesh.partition.store import check_model_dir, resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer
    from hetmesh.testbed.cgroups import detect
    from hetmesh.testbed.mesh import HostSpec, open_mesh_testbed, plan_of, wait_for

    model_dir = resolve_model(args.model)
    config = check_model_dir(model_dir)
    num_layers = int(config["num_hidden_layers"])
    weights_file = model_dir / "model.safetensors"
    with weights_file.open("rb") as handle:
        data_start, header = read_safetensors_header(handle, weights_file)
    prompt_ids = encode_prompt(load_tokenizer(model_dir), PROMPT)
    drop_cached(weights_file)  # every run starts cold: the nodes read the file from disk
    limit = parse_size(args.memory_limit)
    n_hosts = args.hosts + (1 if args.standby else 0)
    headroom = parse_size(args.runtime_headroom)
    # what each node offers the planner: the planner charges stages only (weights, KV,
    # workspace, a 64 MiB reserve), not the node process itself (see the journal)
    offer = f"{(limit - headroom) >> 20}MiB" if headroom else None
    specs = [HostSpec(memory_limit_bytes=limit, max_memory=offer) for _ in range(n_hosts)]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hetmesh-bigmodel-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for old_log in workdir.glob("h*.log"):  # the nodes append: a reused folder starts clean
        old_log.unlink()
    log(f"model {args.model} at {model_dir}; {n_hosts} hosts of {args.memory_limit}; {workdir}")
    hierarchy = detect()
    assert hierarchy is not None
    out: dict[str, Any] = {
        "model": args.model,
        "memory_limit": args.memory_limit,
        "offered": offer or "the cgroup limit",
    }
    with open_mesh_testbed(workdir, specs) as bed:
        node_args: tuple[str, ...] = ("--model", args.model, *NODE_ARGS)
        if args.block_step_ms:  # announce it instead of calibrating (minutes here)
            node_args += ("--block-step-ms", str(args.block_step_ms))
        started: dict[int, float] = {}
        started_epoch: dict[int, float] = {0: time.time()}
        started[0] = time.monotonic()
        first = bed.start_node(0, *node_args)

        def first_listens() -> str | None:
            if first.proc.poll() is not None:
                raise RuntimeError(f"node on host 0 exited:\n{first.log()[-3000:]}")
            return listening_addr(first.log())

        # the others start as soon as the first listens (their bootstrap peer), not once
        # it is up: hosts started together, as a user starts them; the first one's
        # start → serving still holds the wait for the others (its imports' lead)
        bootstrap = wait_for(first_listens, args.timeout, "host 0 to listen", every_s=0.1)
        for h in range(1, n_hosts):
            started[h] = time.monotonic()
            started_epoch[h] = time.time()
            bed.start_node(h, *node_args, bootstrap=bootstrap)
        for node in bed.nodes:
            node.wait_up(args.timeout)
        # each host's memory with its node up (profiled, calibrated) and no stage yet
        runtime = {h: _usage(bed.net.hosts[h].cgroups) for h in range(n_hosts)}
        sampler = StatSampler([bed.net.hosts[h].cgroups for h in range(n_hosts)])
        sampler.start()
        log("nodes up; waiting for the plan to be served")
        ready_at: dict[tuple[str, int, int], float] = {}
        cpu_at: dict[tuple[str, int, int], dict[int, float]] = {}
        plan_at: list[float] = []

        def serving() -> dict[str, Any] | None:
            for node in bed.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(
                        f"node on host {node.host} exited with {node.proc.returncode}:\n"
                        + node.log()[-3000:]
                    )
            try:
                view = bed.status(timeout_s=60.0)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                return None
            now = time.monotonic()
            for key in ready_stages(view):
                if key not in ready_at:
                    ready_at[key] = now
                    # every node's CPU time then: the stage host's is read once hosts are known
                    cpu_at[key] = {n.host: cpu_seconds(n.proc.pid) for n in bed.nodes}
            plan = plan_of(view)
            if plan is None:
                return None
            if not plan_at:
                plan_at.append(now)
                log(f"plan adopted: {[(s.start, s.end) for s in plan.pipelines[0].stages]}")
            want = {(s.peer_id, s.start, s.end) for p in plan.pipelines for s in p.stages}
            return view if want <= ready_at.keys() else None

        view = wait_for(serving, args.timeout, "the mesh to serve", every_s=2.0)
        plan = plan_of(view)
        assert plan is not None
        hosts = bed.peer_host()
        primary = plan.pipelines[0].stages
        out["placed_stages"] = len(primary)
        out["plan"] = [
            {
                "host": hosts[s.peer_id],
                "units": [s.start, s.end],
                "weights": s.weights,
                "planned_mib": s.memory_bytes >> 20,
            }
            for s in primary
        ]
        standbys = [
            {
                "host": hosts[s.peer_id],
                "units": [s.start, s.end],
                "planned_mib": s.memory_bytes >> 20,
            }
            for p in plan.pipelines[1:]
            for s in p.stages
            if all(s.peer_id != q.peer_id for q in primary)
        ]
        out["standby"] = standbys
        log(f"serving: {json.dumps(out['plan'])}; standby {standbys}")

        gen = bed.generate(prompt_ids, args.tokens, timeout_s=args.timeout)[0]
        if "tokens" not in gen:
            raise RuntimeError(f"generation failed: {gen}")
        out["mesh_tokens"] = gen["tokens"]
        out["decode_s_per_token"] = (
            round((gen["times_s"][-1] - gen["times_s"][0]) / (len(gen["times_s"]) - 1), 2)
            if len(gen["times_s"]) > 1
            else None
        )
        log(f"mesh tokens {gen['tokens']}")

        # memory: each host's cgroup peak against what the planner charged it
        distinct = {(s.peer_id, s.start, s.end): s for p in plan.pipelines for s in p.stages}
        charged: dict[int, int] = {}
        for s in distinct.values():  # a stage shared by two pipelines is charged once
            charged[hosts[s.peer_id]] = charged.get(hosts[s.peer_id], 0) + s.memory_bytes
        peaks = {h: hierarchy.memory_peak_bytes(bed.net.hosts[h].cgroups) for h in charged}
        out["hosts"] = {
            str(h): {
                "charged_mib": charged[h] >> 20,
                "peak_mib": peaks[h] >> 20,
                "peak_over_charged": round(peaks[h] / charged[h], 3),
                "runtime_before_plan_mib": runtime[h] >> 20,
                "peak_over_charged_plus_runtime": round(peaks[h] / (charged[h] + runtime[h]), 3),
                # memory.stat every 0.5 s: anonymous memory apart from the file's page cache
                "sampled_max_rss_mib": sampler.max_of(h, "rss") >> 20,
                "sampled_max_cache_mib": sampler.max_of(h, "cache") >> 20,
                "sampled_rss_over_charged": round(sampler.max_of(h, "rss") / charged[h], 3),
            }
            for h in sorted(charged)
        }
        out["rss_over_planned_max"] = ratio_max((peaks[h], charged[h]) for h in charged)
        out["sampled_rss_over_planned_max"] = ratio_max(
            (sampler.max_of(h, "rss"), charged[h]) for h in charged
        )
        sampler.stop()

        # start to serving against a cold-ish read of the same bytes
        per_host: dict[str, dict[str, Any]] = {}
        node_of = {n.host: n for n in bed.nodes}
        tied = not any(k.startswith("lm_head.") for k in header)

        def spans_of(start: int, end: int) -> list[tuple[int, int]]:
            prefixes = unit_prefixes(start, end, num_layers, tied=tied)
            return stage_spans(header, data_start, prefixes)

        for s in primary:
            h = hosts[s.peer_id]
            spans = spans_of(s.start, s.end)
            nbytes = sum(n for _, n in spans)
            read_s = read_cold(weights_file, spans)
            polled_s = ready_at[(s.peer_id, s.start, s.end)] - started[h]
            # the moment its stage was ready, by the node's own log (the status poll
            # above sees it up to its period and a status call later)
            ready_epoch = log_stamp(node_of[h].log(), f"stage [{s.start}, {s.end}) ready")
            up_s = ready_epoch - started_epoch[h] if ready_epoch is not None else polled_s
            load_s = ready_at[(s.peer_id, s.start, s.end)] - plan_at[0]
            per_host[str(h)] = {
                "stage_mb": round(nbytes / 1e6, 1),
                "disk_read_s": round(read_s, 4),
                "disk_mb_per_s": round(nbytes / 1e6 / read_s, 1),
                "start_to_serving_s": round(up_s, 2),
                "start_to_serving_polled_s": round(polled_s, 1),
                # the node process's own CPU time to then: what its start-up and load cost
                # apart from waiting for the machine's other work (shared cores)
                "start_to_serving_cpu_s": round(cpu_at[(s.peer_id, s.start, s.end)][h], 1),
                "plan_to_ready_s": round(load_s, 1),
                # start → serving split by the node's log (start_phases)
                "phases": start_phases(node_of[h].log(), started_epoch[h], s.start, s.end),
            }
        out["stage_hosts"] = per_host
        out["start_to_serving_over_disk_read"] = ratio_max(
            (v["start_to_serving_s"], v["disk_read_s"]) for v in per_host.values()
        )
        out["start_to_serving_cpu_over_disk_read"] = ratio_max(
            (v["start_to_serving_cpu_s"], v["disk_read_s"]) for v in per_host.values()
        )
        out["load_over_disk_read"] = ratio_max(
            (v["plan_to_ready_s"], v["disk_read_s"]) for v in per_host.values()
        )
        out["disk_read"] = "posix_fadvise(POSIX_FADV_DONTNEED) on the file, then pread 16 MiB"
        # the testbed's hosts share one disk: every stage of the plan (standbys too) read
        # at once is what their loads, started together, compete for
        out["all_stages_disk_read_together_s"] = round(
            read_cold_together(weights_file, [spans_of(s.start, s.end) for s in distinct.values()]),
            3,
        )
        out["load_over_disk_read_together"] = round(
            max(v["phases"].get("load_s", 0.0) for v in per_host.values())
            / out["all_stages_disk_read_together_s"],
            3,
        )

        if args.standby and standbys:
            out["failover"] = failover(bed, plan, hosts, prompt_ids, args)
        bed.stop_nodes()
    log("mesh down; loading the reference (one process, int4)")
    out["reference_tokens"] = reference(model_dir, prompt_ids, args.failover_tokens)
    ref = out["reference_tokens"]
    out["outputs_identical"] = out["mesh_tokens"] == ref[: len(out["mesh_tokens"])]
    if "failover" in out:
        got = out["failover"].get("tokens", [])
        out["failover_outputs_identical"] = got == ref[: args.failover_tokens]
    return out


_V2_STAT = {"anon": "rss", "file": "cache"}  # cgroup v2 memory.stat names -> v1's


class StatSampler(threading.Thread):
    """Reads each host's cgroup ``memory.stat`` (v1 ``rss``/``cache``, v2 ``anon``/``file``)
    every 0.5 s and keeps the largest value of each: the cgroup's own peak
    (``memory.max_usage_in_bytes``) counts the model file's page cache as well."""

    def __init__(self, groups: Sequence[Sequence[Path]]) -> None:
        super().__init__(daemon=True)
        self.groups = groups
        self.maxima: list[dict[str, int]] = [{} for _ in groups]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for i, dirs in enumerate(self.groups):
                for d in dirs:
                    stat = d / "memory.stat"
                    if not stat.exists():
                        continue
                    for line in stat.read_text().splitlines():
                        key, _, value = line.partition(" ")
                        key = _V2_STAT.get(key, key)
                        if key in ("rss", "cache"):
                            self.maxima[i][key] = max(self.maxima[i].get(key, 0), int(value))

    def max_of(self, host: int, key: str) -> int:
        return self.maxima[host].get(key, 0)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


def _usage(groups: Sequence[Path]) -> int:
    """A host's memory in use now (cgroup v1 ``memory.usage_in_bytes`` / v2 ``memory.current``)."""
    for group in groups:
        for name in ("memory.usage_in_bytes", "memory.current"):
            if (group / name).exists():
                return int((group / name).read_text())
    return 0


def failover(
    bed: Any, plan: Any, hosts: dict[str, int], prompt_ids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Stream through host 0's node; SIGKILL the host whose stage the standby backs up."""
    primary = plan.pipelines[0].stages
    prim_peers = {s.peer_id for s in primary}
    backed = next(
        (s.start, s.end)
        for p in plan.pipelines[1:]
        for s in p.stages
        if s.peer_id not in prim_peers
    )
    victim_stage = next(s for s in primary if (s.start, s.end) == backed)
    victim = hosts[victim_stage.peer_id]
    entry = next(n for n in bed.nodes if n.host != victim and n.peer_id in prim_peers)
    argv = bed.net.argv(
        entry.host,
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--stream-client",
            entry.addr,
            "--secret",
            bed.secret,
            "--prompt-ids",
            ",".join(map(str, prompt_ids)),
            "--tokens",
            str(args.failover_tokens),
        ],
    )
    from hetmesh.testbed.mesh import child_env

    log(f"failover: stream from host {entry.host}, host {victim} (units {backed}) dies")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env())
    tokens: list[int] = []
    result: dict[str, Any] = {"victim_host": victim, "victim_units": list(backed)}
    killed_at = None
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            event = json.loads(line)
            if "token" in event:
                tokens.append(int(event["token"]))
                if len(tokens) == args.kill_after and killed_at is None:
                    victim_node = next(n for n in bed.nodes if n.host == victim)
                    os.kill(victim_node.proc.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    log(f"SIGKILLed host {victim} after {len(tokens)} tokens")
            else:
                result.update(event)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    result["tokens"] = tokens
    result["killed_after_tokens"] = args.kill_after if killed_at else None
    log(f"failover stream: {result}")
    return result


def reference(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams

    pipeline = LocalPipeline.load(model_dir, 1, weights="int4")
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    return list(pipeline.generate_ids(prompt_ids, params, eos_ids=set()))


def parse_size(text: str) -> int:
    from hetmesh.cli.node import parse_size as parse

    return parse(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synth-llama-3.1-8b")
    parser.add_argument("--memory-limit", default="2GiB", help="cgroup memory limit per host")
    parser.add_argument(
        "--runtime-headroom",
        default="300MiB",
        help="each node offers the planner its limit less this (its own process); 0: all",
    )
    parser.add_argument(
        "--block-step-ms",
        type=float,
        default=0.0,
        help="every node announces this int4 block step instead of calibrating (0: calibrate)",
    )
    parser.add_argument("--hosts", type=int, default=3, help="stage hosts (plus the standby)")
    parser.add_argument("--standby", type=int, default=1, help="1: a standby host, failover")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--failover-tokens", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--stream-client", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--secret", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_client:
        import trio

        ids = [int(t) for t in args.prompt_ids.split(",")]
        trio.run(_stream, args.stream_client, args.secret, ids, args.tokens)
        return 0
    from hetmesh.testbed.mesh import why_no_testbed

    why = why_no_testbed()
    if why:
        print(f"cannot build the testbed here: {why}", file=sys.stderr)
        return 2
    began, load_before = time.monotonic(), os.getloadavg()[0]
    out = run(args)
    out["seconds"] = round(time.monotonic() - began, 1)
    out["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    keys = (
        "placed_stages",
        "outputs_identical",
        "rss_over_planned_max",
        "start_to_serving_over_disk_read",
        "start_to_serving_cpu_over_disk_read",
        "load_over_disk_read",
        "failover_outputs_identical",
        "seconds",
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    for key in keys:
        print(f"{key}: {out.get(key, 'not run')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
