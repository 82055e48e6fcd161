"""Exactness benchmark (issue 44): a busy mesh's greedy streams equal one process's.

    python bench/exact.py --json               # the issue's run: >= 200 streams
    python bench/exact.py --quick --json       # fewer streams, formats and freezes

For each weight format (``--formats``: int4, int8, bfloat16, float32) it starts
two loopback meshes of node processes (``hetmesh.testbed.local_mesh``) serving the
default model in that format:

* ``replicas``: three nodes, each able to hold the whole model;
* ``cut``: three nodes whose ``--max-memory`` is too small for the whole model
  (the planner cuts it into stages; the layout served is reported).

Each mesh's KV pool is small (``--pool-tokens`` per stage), so sessions are
preempted and resumed by replaying their history. ``--clients`` concurrent
clients run a seeded mix of greedy streams: prompts of 8 to 1,000 random token
ids, 16 to 200 new tokens. Every finished stream is compared, token for token,
with one process (one stage) holding the model in the same format. That process
computes the streams beside each other, as a stage would: each prompt prefilled
whole and alone, then decode rounds of up to 16 streams (a row's result does not
depend on its round: what this bench checks of the mesh; the rounds share
their weight reads, which one stream after another does not); every ``--serial-every``-th
stream is also generated alone, one token per call, as ``hetmesh generate`` does,
and ``reference_serial_disagree`` counts those that differ from the rounds' (0).
The reference depends on the stream mix only, so it runs in a process of its own
beside the meshes: every mesh, the freeze mesh and each format's reference is a
job, ``--parallel`` of them at once (a 2-core machine then spends its time
computing, not waiting on one mesh's start or its slowest stream), all compared
at the end; ``load_average`` samples the machine's 1-minute load during the run.
``--save DIR`` keeps each job's outcome as it ends and reuses it in a later run of
the same configuration (a run interrupted, or split over sessions, resumes).
``<format>_identical_ratio`` is the share of that format's streams equal to the
reference; ``streams_checked`` counts them all. ``phase_seconds`` says where the
run's time went (each mesh, its start included (``_ready``), each reference).

``freeze_runs_identical``: on the int4 replicas mesh, ``--freeze-runs`` times, a
stream of 120 tokens after a chat-sized prompt runs; at its 20th token the
replica computing it (the one whose CPU time grows while tokens come, or the one
whose announced load shows the session) gets SIGSTOP and, once 3 more tokens came
(the session replayed on the other replica: ``freeze_runs_recovered``) or 20 s
passed, SIGCONT (the stream is read meanwhile). A run whose serving replica is
not clear within 30 s (a starved machine), or whose stream ended first, froze
nothing: its stream is still compared, and the run is made again
(``freeze_runs_redone``, at most ``--freeze-runs`` more). 1 only when
``--freeze-runs`` runs froze their replica (``freeze_runs_frozen``) and every
stream made equals one process (which equals the stream generated alone).

A mesh that does not start (a node not up in 300 s, or one that exited, on a
starved machine) is torn down and started again, up to 3 starts
(``mesh_start_retries`` counts them, ``mesh_start_failures`` says why); only
its streams' outcome counts, so no key is weakened.

``--speed`` instead measures what exactness costs, in one process: the default
model in ``--speed-format`` loaded three times (``exact``: exact attention and,
in float32/bfloat16, row-invariant linear layers; ``plain_linear``: exact attention,
torch's linear layers; ``sdpa``: torch's attention and linear layers), measured
in alternation in the same run, CPU time of one thread (steadier than wall time
on a shared machine): a decode step of one session, a decode round of 8
sessions, a 291-token prefill; and ``exact_padded``: a decode step and a round of
the ``exact`` stage with its fp32 layers' few rows padded (to 4 on AMD's EPYC, the
way before the exact kernel, :mod:`hetmesh.partition.exact_kernel`; to 2 before
1-row packed calls; ``speed_lone_row_layers`` counts the layers taking the kernel
or 1-row calls).

Figures are ratios of equal streams: a loaded machine makes the run slower,
never different. A stream the mesh refuses as busy (admission: every pipeline
full) is asked again a second later, as a client would (``busy_refusals``
counts those; ``preemptions`` sums the sessions the stages preempted for KV
room, as their announced counters say). A stream the mesh fails (on a starved
machine a stage that computes a long prefill for 30 s is suspected and avoided,
and a stream may then find no route) is asked again up to 5 times
(``streams_retried``); what the failed try delivered must be a prefix of the
reference (``retried_prefix_differs`` counts those that are not: 0). A stream
refused before its first token for want of a route (``NoRoute``: the mesh
replans, e.g. on a link's measured bandwidth drifting on a loaded machine) is
asked again every 2 s, up to 20 min a try (``route_refusals``). A stream
failed every time is counted in ``streams_failed``, not compared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from hetmesh.errors import InsufficientCapacity, MeshError, NoRoute, Rejected

T = TypeVar("T")

FORMATS = ("int4", "int8", "bfloat16", "float32")
CONTEXT = 1536
GATEWAY_MEMORY = "1MiB"  # the freeze mesh's gateway: room for no unit of the model
ROUTE_WAIT_S = 1200  # how long a stream is asked again while the mesh has no route
STREAM_RETRIES = 5  # a stream the mesh failed is asked again up to 5 times
FREEZE_TOKENS = 120  # the freeze runs' stream length
REFERENCE_ROUND = 16  # the reference's decode rounds: as many rows as clients
# what one node may offer for the whole model with its pool (replicas), and a cap
# under the whole model's need in each format (weights + KV budget + workspace: ~315
# MiB in int4, ~345 in int8, ~470 in bf16) that makes the planner cut it
WHOLE_MEMORY = "2GiB"
CUT_MEMORY = {"int4": "240MiB", "int8": "260MiB", "bfloat16": "340MiB", "float32": "520MiB"}
MESH_STARTS = 3  # a mesh that does not start (a node starved at load 25) is started again
NODE_START_S = 300.0  # how long one node may take to start (its model loaded)
SERVE_WAIT_S = 600.0  # how long a started mesh may take to serve


def start_with_retries(
    start: Callable[[], T], what: str, tries: int = MESH_STARTS, retries: list[str] | None = None
) -> T:
    """``start()``, tried again (up to ``tries`` times in all) while it raises a
    :class:`MeshError` (a node that did not start or exited, a mesh that did not serve);
    each failure is logged and appended to ``retries``; the last one raises."""
    for attempt in range(1, tries + 1):
        try:
            return start()
        except MeshError as exc:
            if attempt == tries:
                raise
            print(f"{what}: start {attempt} of {tries} failed: {exc!r}", file=sys.stderr)
            if retries is not None:
                retries.append(repr(exc))
    raise AssertionError("unreachable")  # tries >= 1 returns or raises above


@contextlib.contextmanager
def started_mesh(
    what: str,
    node_args: Sequence[str],
    *,
    per_node_args: Sequence[Sequence[str]] = (),
    pipelines: int = 1,
    retries: list[str],
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A 3-node local mesh serving ``pipelines`` pipelines, and its view; a start
    that fails (see :func:`start_with_retries`) is torn down and made again."""
    from hetmesh.testbed.local_mesh import local_mesh, wait_serving

    def start() -> tuple[contextlib.ExitStack, Any, dict[str, Any]]:
        stack = contextlib.ExitStack()
        try:
            opened = local_mesh(
                3, node_args=node_args, per_node_args=per_node_args, start_timeout_s=NODE_START_S
            )
            mesh = stack.enter_context(opened)
            view = wait_serving(mesh, pipelines=pipelines, timeout_s=SERVE_WAIT_S)
        except BaseException:
            stack.close()
            raise
        return stack, mesh, view

    stack, mesh, view = start_with_retries(start, what, retries=retries)
    with stack:
        yield mesh, view


def stream_mix(seed: int, count: int, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per stream: prompts 8-1,000 tokens, outputs 16-200."""
    rng = random.Random(seed)
    longest, most = (300, 32) if quick else (1000, 200)
    return [
        (
            [rng.randrange(200, 20000) for _ in range(rng.randint(8, longest))],
            rng.randint(16, most),
        )
        for _ in range(count)
    ]


async def _collect(client: Any, prompt: list[int], tokens: int, got: list[int]) -> list[int]:
    """The stream's tokens, appended to ``got`` as they come (a failed stream's part
    stays there)."""
    from hetmesh.client.mesh import TokenEvent

    events = client.stream(prompt_ids=prompt, max_new_tokens=tokens)
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                got.append(event.token_id)
    return got


def mesh_streams(
    fmt: str,
    memory: str,
    mix: Sequence[tuple[list[int], int]],
    clients: int,
    pool_tokens: int,
    pipelines: int = 1,
) -> dict[str, Any]:
    """Run ``mix`` through a fresh 3-node mesh in ``fmt``; its finished streams."""
    import trio

    from hetmesh.client.mesh import open_mesh_client

    args = [
        *("--weights", fmt, "--max-memory", memory, "--max-context", str(CONTEXT)),
        *("--kv-pool-tokens", str(pool_tokens)),
    ]
    done: list[tuple[int, list[int]]] = []  # (index in mix, tokens)
    partial: list[tuple[int, list[int]]] = []  # failed tries: what they delivered
    failed = busy = retried = unrouted = 0
    preempted: list[int] = []
    start_retries: list[str] = []
    began = time.perf_counter()
    what = f"{fmt} mesh ({memory})"
    with started_mesh(what, args, pipelines=pipelines, retries=start_retries) as (mesh, view):
        ready_s = time.perf_counter() - began
        # the units each node holds: whole-model replicas, or a cut
        layout = sorted(
            [(s["start"], s["end"]) for s in p["record"]["stages"]] for p in view["peers"]
        )

        async def run() -> None:
            async with open_mesh_client(mesh.addr, mesh_secret=mesh.secret, timeout_s=1800) as c:
                turn = iter(enumerate(mix))

                async def client() -> None:
                    nonlocal failed, busy, retried, unrouted
                    for n, (prompt, tokens) in turn:
                        tries = 0
                        give_up = time.monotonic() + ROUTE_WAIT_S
                        while True:
                            got: list[int] = []
                            try:
                                done.append((n, await _collect(c, prompt, tokens, got)))
                            except Rejected as exc:
                                if "busy" not in str(exc):
                                    raise
                                # a full mesh refuses at admission: a client asks again
                                busy += 1
                                await trio.sleep(1.0)
                                continue
                            except MeshError as exc:
                                refused = isinstance(exc, (NoRoute, InsufficientCapacity))
                                if refused and not got and time.monotonic() < give_up:
                                    # refused before a token: no pipeline ready (the mesh
                                    # replans, e.g. on link drift, or suspects a starved
                                    # stage): a client asks again once it routes
                                    unrouted += 1
                                    await trio.sleep(2.0)
                                    continue
                                # the mesh gave up on it (e.g. no route while a starved
                                # stage is suspected): what it delivered is checked as a
                                # prefix, and a client asks again
                                partial.append((n, got))
                                print(f"{fmt}: stream failed: {exc!r}", file=sys.stderr)
                                tries += 1
                                if tries <= STREAM_RETRIES:
                                    retried += 1
                                    # each try may wait for a route afresh: else, once
                                    # one long outage used the wait, the next refusals
                                    # spend the retries 2 s apart
                                    give_up = time.monotonic() + ROUTE_WAIT_S
                                    await trio.sleep(2.0)
                                    continue
                                failed += 1
                            break

                async with trio.open_nursery() as nursery:
                    for _ in range(clients):
                        nursery.start_soon(client)
                await trio.sleep(5)  # the stages' counters are announced every few seconds
                preempted.append(_preemptions(await c.status()))

        trio.run(run)
    return {
        "done": done,
        "partial": partial,
        "retried": retried,
        "unrouted": unrouted,
        "failed": failed,
        "busy": busy,
        "layout": layout,
        "preempted": preempted[0] if preempted else 0,
        "ready_s": round(ready_s, 1),
        "start_retries": start_retries,
    }


def _preemptions(view: dict[str, Any]) -> int:
    """Sessions the mesh's stages preempted for KV room, as their counters announce."""
    from hetmesh.scheduler.announcement import read_serving

    total = 0
    for peer in view["peers"]:
        record = peer.get("record") or {}
        serving = read_serving(record.get("extra"), record.get("stages") or (), plan_of=None)
        total += sum(int(float(str(c.get("kv_preempted", 0)))) for c in serving.stage_servers)
    return total


def reference(
    fmt: str, streams: Sequence[tuple[list[int], int]], serial: Sequence[int] = ()
) -> dict[str, Any]:
    """One process's tokens for ``streams``, holding the model in ``fmt``.

    The process computes them as a mesh's stage would, beside each other: each prompt
    prefilled whole, alone, then decode rounds of up to :data:`REFERENCE_ROUND` streams
    (each row's result is independent of the round's others: that is what exactness
    means, proved per shape at load and by tests). The streams at the ``serial``
    indices are also generated alone, one token per call (``LocalPipeline.generate_ids``,
    what ``hetmesh generate`` does): ``alone`` maps each such index to its tokens, which
    must equal the rounds' (or the reference itself is not exact)."""
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import eos_token_ids, load_tokenizer

    model_dir = resolve_model()
    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(model_dir, 1, weights=fmt)
    stage = pipeline.stages[0]
    eos = eos_token_ids(model_dir, load_tokenizer(model_dir))
    wants: list[list[int]] = []
    for lo in range(0, len(streams), REFERENCE_ROUND):
        group = streams[lo : lo + REFERENCE_ROUND]
        sessions = [pipeline.new_session(SamplingParams(max_new_tokens=t)) for _, t in group]
        outs: list[list[int]] = [[] for _ in group]
        live: list[int] = []
        with torch.inference_mode():
            for n, ((prompt, tokens), session) in enumerate(zip(group, sessions, strict=True)):
                logits = stage.forward(torch.tensor(prompt), session.kvs[0], last_only=True)
                token = session.sampler(logits[-1], 0)
                if token not in eos and tokens > 0:
                    outs[n].append(token)
                    live.append(n)
            while live:
                live = [n for n in live if len(outs[n]) < group[n][1]]
                rows = [(torch.tensor(outs[n][-1:]), sessions[n].kvs[0]) for n in live]
                logits_per_row = stage.forward_batch(rows, last_only=True) if rows else []
                still = []
                for n, logits in zip(live, logits_per_row, strict=True):
                    token = sessions[n].sampler(logits[-1], len(outs[n]))
                    if token not in eos:
                        outs[n].append(token)
                        still.append(n)
                live = still
        for session in sessions:
            session.free()
        wants.extend(outs)
    alone: dict[int, list[int]] = {}
    for n in serial:
        prompt, tokens = streams[n]
        alone[n] = list(
            pipeline.generate_ids(prompt, SamplingParams(max_new_tokens=tokens), eos_ids=eos)
        )
    return {"wants": wants, "alone": alone}


def compare(
    fmt: str,
    streams: Sequence[tuple[list[int], int]],
    done: Sequence[tuple[int, list[int]]],
    wants: Sequence[list[int]],
) -> int:
    """How many finished streams (index, tokens) equal the reference's ``wants``."""
    equal = 0
    for n, got in done:
        want = wants[n]
        equal += want == got
        if want != got:
            first = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None
            )
            print(f"{fmt}: a {len(streams[n][0])}-token prompt differs at {first}", file=sys.stderr)
    return equal


def reference_in_process(
    fmt: str, streams: Sequence[tuple[list[int], int]], serial: Sequence[int], workdir: Path
) -> dict[str, Any]:
    """:func:`reference` in a process of its own (it runs beside the meshes: the
    reference depends on the stream mix only, not on what a mesh returned)."""
    job, out = workdir / f"{fmt}-job.json", workdir / f"{fmt}-out.json"
    job.write_text(json.dumps({"format": fmt, "streams": streams, "serial": list(serial)}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, str(Path(__file__).resolve()), "--reference-job", str(job), str(out)]
    code = subprocess.run(argv, env=env, check=False).returncode
    if code != 0:
        raise RuntimeError(f"{fmt}: the reference process exited with {code}")
    got = json.loads(out.read_text())
    return {"wants": got["wants"], "alone": {int(k): v for k, v in got["alone"].items()}}


class _Load:
    """The machine's 1-minute load average, sampled every 5 s while a run goes on."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        s = self.samples
        return {
            "start": round(s[0], 2),
            "mean": round(sum(s) / len(s), 2),
            "min": round(min(s), 2),
            "max": round(max(s), 2),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mesh, the freeze mesh and every reference process as a job; at most
    ``args.parallel`` jobs at once (a format's meshes and its reference are independent:
    the reference depends on the stream mix only; they are compared at the end)."""
    per_format = max(1, args.streams // (2 * len(args.formats)))
    result: dict[str, Any] = {
        "streams_checked": 0,
        "streams_failed": 0,
        "busy_refusals": 0,
        "streams_retried": 0,
        "route_refusals": 0,
        "retried_prefix_differs": 0,
        "preemptions": 0,
        "reference_serial_checked": 0,
        "reference_serial_disagree": 0,
    }
    began = time.perf_counter()
    load = _Load()
    phases: dict[str, float] = {}  # seconds per job: where a run's time goes
    formats = list(args.formats if args.streams else ())
    topologies = (("replicas", WHOLE_MEMORY, 2), ("cut", "", 1))
    mixes = {
        (fmt, topology): stream_mix(100 * i + len(topology), per_format, args.quick)
        for i, fmt in enumerate(formats)
        for topology, _, _ in topologies
    }
    # per format, the streams the reference computes: both meshes' mixes, then (int4)
    # the freeze stream; every serial_every-th one, and the freeze stream, also alone
    ref_streams = {f: mixes[f, "replicas"] + mixes[f, "cut"] for f in formats}
    serial = {
        f: list(range(0, len(s), args.serial_every)) if args.serial_every else []
        for f, s in ref_streams.items()
    }
    freeze_prompt = stream_mix(7, 1, True)[0][0][:60]
    freeze_at = -1
    if args.freeze_runs:
        ref_streams.setdefault("int4", [])
        serial.setdefault("int4", [])
        freeze_at = len(ref_streams["int4"])
        ref_streams["int4"] = [*ref_streams["int4"], (freeze_prompt, FREEZE_TOKENS)]
        serial["int4"].append(freeze_at)
    outcome: dict[str, Any] = {}

    # what decides the jobs' outcomes: a saved outcome is reused only for the same
    config = [formats, args.streams, args.quick, args.pool_tokens, args.clients]
    config += [args.freeze_runs, args.serial_every]

    def timed(name: str, fn: Any, *fn_args: Any) -> None:
        saved = Path(args.save) / f"{name}.json" if args.save else None
        if saved is not None and saved.exists():
            data = json.loads(saved.read_text())
            if data["config"] == json.loads(json.dumps(config)):
                outcome[name], phases[name] = data["outcome"], data["seconds"]
                if name.endswith("_reference"):
                    alone = outcome[name]["alone"]
                    outcome[name]["alone"] = {int(k): v for k, v in alone.items()}
                print(f"{name}: saved outcome reused ({saved})", file=sys.stderr, flush=True)
                return
        start = time.perf_counter()
        outcome[name] = fn(*fn_args)
        phases[name] = round(time.perf_counter() - start, 1)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            data = {"config": config, "outcome": outcome[name], "seconds": phases[name]}
            saved.write_text(json.dumps(data))
        at = time.perf_counter() - began
        print(f"{name}: done in {phases[name]} s, at {at:.0f} s", file=sys.stderr, flush=True)

    jobs: list[tuple[Any, ...]] = []
    if args.freeze_runs:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from exact_freeze import freeze_stream

        freeze = (freeze_prompt, FREEZE_TOKENS, args.freeze_runs, args.pool_tokens)
        jobs.append(("freeze", freeze_stream, *freeze))
    with tempfile.TemporaryDirectory(prefix="hetmesh-exact-") as tmp:
        # the slowest format (float32) first; a format's reference before its meshes
        # (one process, the longest job of its format)
        for fmt in reversed(list(ref_streams)):
            ref = (fmt, ref_streams[fmt], serial[fmt], Path(tmp))
            jobs.append((f"{fmt}_reference", reference_in_process, *ref))
            for topology, memory, pipelines in topologies if fmt in formats else ():
                mesh = (fmt, memory or CUT_MEMORY[fmt], mixes[fmt, topology], args.clients)
                job = (f"{fmt}_{topology}", mesh_streams, *mesh, args.pool_tokens, pipelines)
                jobs.append(job)
        with concurrent.futures.ThreadPoolExecutor(max(1, args.parallel)) as pool:
            for future in [pool.submit(timed, *job) for job in jobs]:
                future.result()
    start_retries: list[str] = []  # a mesh's failed starts, each made again
    for fmt in formats:
        ref = outcome[f"{fmt}_reference"]
        done: list[tuple[int, list[int]]] = []
        offset = 0
        for topology, _, _ in topologies:
            got = outcome[f"{fmt}_{topology}"]
            done.extend((offset + n, tokens) for n, tokens in got["done"])
            phases[f"{fmt}_{topology}_ready"] = got["ready_s"]  # nodes started, model loaded
            result["streams_failed"] += got["failed"]
            result["busy_refusals"] += got["busy"]
            result["streams_retried"] += got["retried"]
            result["route_refusals"] += got["unrouted"]
            for n, part in got["partial"]:  # a failed try's tokens: a prefix of the stream
                want = ref["wants"][offset + n]
                result["retried_prefix_differs"] += part != want[: len(part)]
            offset += len(mixes[fmt, topology])
            result["preemptions"] += got["preempted"]
            start_retries.extend(got["start_retries"])
            result[f"{fmt}_{topology}_layout"] = got["layout"]
            print(
                f"{fmt} {topology}: {len(got['done'])} streams, {got['failed']} failed, "
                f"{got['busy']} busy refusals asked again, {got['preempted']} preempted, "
                f"layout {got['layout']}",
                file=sys.stderr,
            )
        equal = compare(fmt, ref_streams[fmt], done, ref["wants"])
        alone = {n: t for n, t in ref["alone"].items() if n != freeze_at or fmt != "int4"}
        result["reference_serial_checked"] += len(alone)
        result["reference_serial_disagree"] += sum(t != ref["wants"][n] for n, t in alone.items())
        result["streams_checked"] += len(done)
        key = "bf16" if fmt == "bfloat16" else fmt
        result[f"{key}_identical_ratio"] = round(equal / len(done), 4) if done else 0.0
        result[f"{key}_streams"] = len(done)
    if args.freeze_runs:
        from exact_freeze import judge_freezes

        ref = outcome["int4_reference"]
        want, alone_tokens = ref["wants"][freeze_at], ref["alone"][freeze_at]
        freezes = outcome["freeze"]
        start_retries.extend(freezes["start_retries"])
        # every run made is compared, the redone ones too; the freeze stream is
        # generated alone as well: it must equal the rounds' (see judge_freezes)
        result.update(judge_freezes(freezes["outputs"], args.freeze_runs, want, alone_tokens))
    result["mesh_start_retries"] = len(start_retries)
    result["mesh_start_failures"] = start_retries
    result["phase_seconds"] = phases
    result["parallel_jobs"] = args.parallel
    result["load_average"] = load.summary()
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="few, short streams; one freeze")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=None)
    parser.add_argument(
        "--streams", type=int, default=None, help="streams in all (>= 200; 0: freezes only)"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pool-tokens", type=int, default=None, help="KV tokens per stage")
    parser.add_argument("--freeze-runs", type=int, default=None)
    parser.add_argument(
        "--serial-every",
        type=int,
        default=8,
        help="also generate every Nth stream alone, one token per call (0: none)",
    )
    parser.add_argument("--speed", action="store_true", help="what exactness costs")
    parser.add_argument("--speed-format", choices=FORMATS, default="int4")
    parser.add_argument(
        "--parallel", type=int, default=3, help="meshes and reference processes at once"
    )
    parser.add_argument(
        "--save",
        default=None,
        help="a folder: each job's outcome saved there as it ends, and reused by a later "
        "run of the same configuration (a run split over sessions, or resumed)",
    )
    parser.add_argument("--reference-job", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference_job:  # one reference process (see reference_in_process)
        job = json.loads(Path(args.reference_job[0]).read_text())
        streams = [(list(p), int(t)) for p, t in job["streams"]]
        got = reference(job["format"], streams, job["serial"])
        Path(args.reference_job[1]).write_text(json.dumps(got))
        return
    if args.speed:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from exact_speed import speed

        print(json.dumps(speed(args.speed_format), sort_keys=True))
        return
    args.formats = args.formats or list(FORMATS)
    quick = args.quick
    if args.streams is None:
        args.streams = 4 * len(args.formats) if quick else 208
    args.pool_tokens = args.pool_tokens or (1024 if quick else 4096)
    args.freeze_runs = (1 if quick else 20) if args.freeze_runs is None else args.freeze_runs
    result = run(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
    for key, value in sorted(result.items()):
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
