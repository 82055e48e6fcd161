"""Pipeline benchmark: a three-node loopback mesh against the single-process reference,
in two layouts, one after the other, each with the plan it assumes checked:

- **replicas**: every node holds the whole model (each offered the memory for it),
  and a request runs on one of them: a remote single process, no stage hop;
- **split**: each node is offered memory for only about 1/K of the model
  (``--stages K``, default 3, computed from the model's bytes in the nodes'
  format by :mod:`hetmesh.scheduler.caps`), so the planner must cut it into K
  stages; the run fails if the adopted plan has another shape.

Measured per layout, on the same machine, with the same weight format, the same
torch thread count (one) and no speculative decoding on both sides (the nodes run
``--no-speculative``: the figures are the cut's, not a gateway's drafts); the mesh
and the reference in turn, one mesh stream, then one reference stream, per repeat,
so a machine whose speed drifts moves both alike:

- single-stream decode tokens/s (mesh ÷ reference) -> ``decode_ratio_single_stream``
  (replicas), ``split_decode_ratio``
- time to first token for a 512-token prompt (mesh ÷ reference) -> ``ttft_ratio_512``,
  ``split_ttft_ratio_512``
- aggregate tokens/s of 8 concurrent streams ÷ 1 stream on the mesh ->
  ``concurrency_gain_8``, ``split_concurrency_gain_8``
- whether the mesh's greedy tokens (``--tokens`` after the chat prompt, 16 after the
  512-token one) equal the reference's -> ``outputs_identical``,
  ``split_outputs_identical``
- the plans -> ``plan`` and ``replicas_stages`` (1), ``split_plan`` and ``split_stages``
- where a stream's token goes (nodes read from ``/proc``, Linux; zeros elsewhere): for
  each stage of the first pipeline, its node's CPU a token of the single streams, ms,
  as (busiest thread, all its other threads, the busiest's wait in the run queue) ->
  ``split_stage_cpu_ms`` (the busiest is the reader thread that computes the stage's
  decode steps; the others hold trio, the parked device thread with the stream's
  prefill, the gateway; the wait is the time it was ready to run but every core was
  taken), beside the reference's
  thread CPU a token -> ``split_reference_cpu_ms``, the client's ->
  ``split_client_cpu_ms`` and the planner's ``split_plan_stage_ms``: the busiest
  threads' sum against the reference's is what the forwards cost more in their own
  processes, the token's period less that sum is the hops and the waits
- the same over the 8 concurrent streams, a token of all of them together ->
  ``split_stage_cpu_ms_8``, ``split_client_cpu_ms_8``: the busiest is the device thread
  that runs the stage's rounds (its CPU a token falls as the rounds fill); all the
  processes' CPU a token against twice the tokens' period (two cores) says how busy
  the cores were
- the nodes' fast-path switches as this run set them (empty: unset, on) ->
  ``fast_path_switches`` (``HETMESH_STAGE_GROUPS=0 python bench/pipeline.py`` is the
  run without :mod:`hetmesh.node.stage_groups`)
- the single process today against its path before issue 16 -> ``single_process_speedup``
  (``bench/decode.py``, after the meshes have stopped; ``--no-single-process`` skips it)

``--model`` serves another model (a folder, a .gguf, or a name ``hetmesh model``
knows); ``--prefix`` names its keys (``--model synth-llama-3.2-1b --prefix synth1b_``
gives ``synth1b_split_decode_ratio``…). With the default model, the same split
layout of ``synth-llama-3.2-1b`` (a model of a size people join a mesh for, its
text noise) follows, its keys ``synth1b_split_*`` and its plan checked alike
(``--no-synth1b`` skips it; a machine without the checkpoint says
``synth1b_skipped``; ``hetmesh model synth --shape synth-llama-3.2-1b`` writes it).

Usage: ``python bench/pipeline.py [--json] [--tokens 64] [--repeats 5] [--stages 3]
[--no-replicas] [--no-synth1b] [--weights native] [--model NAME] [--prefix P]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

# no prefix cache: the repeats reuse one prompt, and TTFT here measures a prefill
# (bench/kv.py measures the cache); each layout adds its --max-memory (bench/cut.py)
# the nodes' fast paths, each on unless its variable says 0
FAST_PATHS = (
    "HETMESH_STAGE_LANE",
    "HETMESH_GATEWAY_LANE",
    "HETMESH_SHM_INLINE",
    "HETMESH_STAGE_GROUPS",
    "HETMESH_GATEWAY_LANE_MANY",
    "HETMESH_GATEWAY_LANE_OWN",
    # a stage's decode rounds of several sessions scripted (hetmesh.partition.lean_round)
    "HETMESH_LEAN_ROUND",
    # a stage's longest gap between two frames of one burst, ms (default 5)
    "HETMESH_STAGE_GATHER_MS",
    # a stage's longest wait of a group too small for the micro-batches, ms (default 50)
    "HETMESH_STAGE_MERGE_MS",
    # a stage of a cut's micro-batches (default 2)
    "HETMESH_STAGE_MICRO_BATCHES",
    # the prefill's chunks (hetmesh.partition.prefill): size and cap
    "HETMESH_PREFILL_CHUNK_TOKENS",
    "HETMESH_PREFILL_MAX_CHUNKS",
)
NODE_ARGS = [
    "--threads",  # one, as the reference: the ratios compare like with like
    "1",
    "--max-sessions",
    "8",
    "--max-context",
    "1024",
    "--no-prefix-cache",
    # the cut itself: the reference does not speculate, so neither does the mesh (a
    # gateway's speculative decoding would be measured as the cut's speed)
    "--no-speculative",
]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


class Reference:
    """The single process: the whole model in one :class:`LocalPipeline`, one torch thread."""

    def __init__(self, model_dir: Path, weights: str = "native") -> None:
        import torch

        from hetmesh.partition.generate import LocalPipeline
        from hetmesh.partition.sampling import SamplingParams

        torch.set_num_threads(1)  # the nodes' default
        self.pipeline = LocalPipeline.load(model_dir, 1, weights=weights)
        self._params = SamplingParams
        self.cpu_per_token_s: list[float] = []  # each decode_tpot's thread CPU a token
        self.decode_tpot([1, 2, 3], 4)  # warm up
        self.cpu_per_token_s.clear()

    def decode_tpot(self, prompt_ids: list[int], tokens: int) -> float:
        """Mean time per token after the first, of one greedy stream."""
        params = self._params(max_new_tokens=tokens)
        tokens_out = self.pipeline.generate_ids(prompt_ids, params, eos_ids=set())
        stamps, cpu = [], []
        for _token in tokens_out:
            stamps.append(time.perf_counter())
            cpu.append(time.thread_time())
        self.cpu_per_token_s.append((cpu[-1] - cpu[0]) / (len(cpu) - 1))
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    def ids(self, prompt_ids: list[int], tokens: int) -> list[int]:
        """The greedy tokens the mesh must give (checked once per run)."""
        params = self._params(max_new_tokens=tokens)
        return list(self.pipeline.generate_ids(prompt_ids, params, eos_ids=set()))

    def ttft(self, long_ids: list[int]) -> float:
        began = time.perf_counter()
        for _token in self.pipeline.generate_ids(
            long_ids, self._params(max_new_tokens=1), eos_ids=set()
        ):
            return time.perf_counter() - began
        raise AssertionError("no token")


async def _stream(
    mesh: Any, prompt_ids: list[int], tokens: int, ids: list[int] | None = None
) -> list[float]:
    """Start time, then the arrival time of each token, of one greedy stream (its
    token ids appended to ``ids``)."""
    from hetmesh.client.mesh import TokenEvent

    began = time.perf_counter()
    stamps = [began]
    async for event in mesh.stream(prompt_ids=prompt_ids, max_new_tokens=tokens):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            stamps.append(time.perf_counter())
            if ids is not None:
                ids.append(event.token_id)
    return stamps


CHECKED_TOKENS = 16  # of the 512-token prompt, against the reference


WHOLE = 0  # thread_cpu's key of the whole process (no thread has id 0)


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's CPU seconds so far, and its seconds runnable but waiting for a CPU
    (the run queue), of process ``pid`` (Linux's schedstat; empty elsewhere); under
    :data:`WHOLE`, the process's CPU seconds, its ended threads' included (``stat``'s
    user and system time, in clock ticks)."""
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[WHOLE] = ((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            out[int(tid)] = (int(ran) / 1e9, int(waited) / 1e9)
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def cpu_per_token(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], tokens: int
) -> tuple[float, float, float]:
    """A process's CPU per token between two :func:`thread_cpu` readings, ms: its busiest
    thread's (a stage node's: the reader thread that computes its forwards), the rest of
    the process's (trio, the parked device thread, worker threads, ended ones included,
    the gateway's work), and the busiest thread's wait for a CPU while runnable (the
    cores taken by others)."""
    spent = sorted(
        (
            (ran - before.get(tid, (0.0, 0.0))[0], waited - before.get(tid, (0.0, 0.0))[1])
            for tid, (ran, waited) in after.items()
            if tid != WHOLE
        ),
        reverse=True,
    )
    if not spent or tokens <= 0:
        return 0.0, 0.0, 0.0
    busiest, waited = spent[0]
    rest = sum(ran for ran, _ in spent[1:])
    if WHOLE in before and WHOLE in after:  # ended threads too (the clock's ticks apart)
        rest = max(rest, after[WHOLE][0] - before[WHOLE][0] - busiest)
    ms = 1e3 / tokens
    return busiest * ms, rest * ms, waited * ms


def figures(
    mesh: Any,
    reference: Reference,
    prompt_ids: list[int],
    long_ids: list[int],
    tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """The mesh's figures and the reference's, measured in turn (a drifting machine
    moves both alike): one mesh stream, then one reference stream, and so on."""
    import trio

    from hetmesh.client.mesh import open_mesh_client

    async def measure() -> dict[str, Any]:
        async with open_mesh_client(mesh.nodes[-1].addr, mesh_secret=mesh.secret) as client:
            await _stream(client, prompt_ids, 4)  # warm up: links, first forwards
            # outputs first: the mesh's greedy tokens must be the single process's
            short: list[int] = []
            long: list[int] = []
            await _stream(client, prompt_ids, tokens, short)
            await _stream(client, long_ids, CHECKED_TOKENS, long)
            identical = short == reference.ids(prompt_ids, tokens) and long == reference.ids(
                long_ids, CHECKED_TOKENS
            )
            tpots, ttfts, ref_tpots, ref_ttfts = [], [], [], []
            pids = [node.proc.pid for node in mesh.nodes]
            spent: list[list[tuple[float, float, float]]] = [[] for _ in pids]
            client_cpu = []  # this process's (the client's) CPU a token, s
            for _ in range(repeats):
                before = [thread_cpu(pid) for pid in pids]
                began = time.process_time()
                stamps = await _stream(client, prompt_ids, tokens)
                client_cpu.append((time.process_time() - began) / (len(stamps) - 1))
                after = [thread_cpu(pid) for pid in pids]
                tpots.append((stamps[-1] - stamps[1]) / (len(stamps) - 2))
                for mine, b, a in zip(spent, before, after, strict=True):
                    mine.append(cpu_per_token(b, a, len(stamps) - 1))
                # the reference runs while the idle nodes wait, on the same cores
                ref_tpots.append(reference.decode_tpot(prompt_ids, tokens))
                stamps = await _stream(client, long_ids, 1)
                ttfts.append(stamps[1] - stamps[0])
                ref_ttfts.append(reference.ttft(long_ids))

            spent_8: list[list[tuple[float, float, float]]] = [[] for _ in pids]
            client_cpu_8: list[float] = []

            async def concurrent(streams: int) -> float:
                spans: list[list[float]] = []

                async def one() -> None:
                    spans.append(await _stream(client, prompt_ids, tokens))

                before = [thread_cpu(pid) for pid in pids] if streams > 1 else []
                cpu_began = time.process_time()
                began = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(streams):
                        nursery.start_soon(one)
                elapsed = time.perf_counter() - began
                made = sum(len(s) - 1 for s in spans)
                if before:  # the nodes' CPU a token of all the streams together
                    after = [thread_cpu(pid) for pid in pids]
                    for mine, b, a in zip(spent_8, before, after, strict=True):
                        mine.append(cpu_per_token(b, a, made))
                    client_cpu_8.append((time.process_time() - cpu_began) / max(1, made))
                return made / elapsed

            singles, eights = [], []
            for _ in range(repeats):  # in turn as well
                singles.append(await concurrent(1))
                eights.append(await concurrent(8))
        return {
            "tpot_s": statistics.median(tpots),
            "ttft_512_s": statistics.median(ttfts),
            "reference_tpot_s": statistics.median(ref_tpots),
            "reference_ttft_512_s": statistics.median(ref_ttfts),
            "tokens_per_s_1": statistics.median(singles),
            "tokens_per_s_8": statistics.median(eights),
            "outputs_identical": float(identical),
            "reference_cpu_ms": statistics.median(reference.cpu_per_token_s[-repeats:]) * 1e3,
            "client_cpu_ms": statistics.median(client_cpu) * 1e3,
            "client_cpu_ms_8": statistics.median(client_cpu_8) * 1e3,
            # per node (mesh.nodes' order), one stream's CPU a token, ms, median over the
            # repeats: the busiest thread's (the forwards), the other threads', and the
            # busiest thread's wait for a CPU
            "node_cpu_ms": [
                tuple(round(statistics.median(row[i] for row in mine), 3) for i in range(3))
                for mine in spent
            ],
            # the same during the 8 streams, a token of all of them together
            "node_cpu_ms_8": [
                tuple(round(statistics.median(row[i] for row in mine), 3) for i in range(3))
                for mine in spent_8
            ],
        }

    return trio.run(measure)


def run_layout(
    model_dir: Path,
    reference: Reference,
    stages: int,
    args: argparse.Namespace,
    prompt_ids: list[int],
    long_ids: list[int],
) -> dict[str, Any]:
    """One mesh whose nodes can each hold 1/``stages`` of the model (1: all of it), its
    plan checked, and its figures against ``reference``."""
    import cut  # bench/cut.py, beside this file

    from hetmesh.scheduler.replan import newest_in_view
    from hetmesh.testbed.local_mesh import local_mesh, wait_settled

    node_args = [*NODE_ARGS, "--weights", args.weights, "--model", str(model_dir)]
    node_args = cut.node_args_for(model_dir, stages, node_args)
    nodes = max(3, stages)
    with local_mesh(nodes, node_args=node_args) as mesh:
        # every planned pipeline loaded, or the first repeats would share the cores with
        # the standbys' loading (and run on whichever replica happened to be ready)
        plan = newest_in_view(wait_settled(mesh))
        names = cut.node_names(n.peer_id for n in mesh.nodes)
        what = "whole-model replicas" if stages == 1 else f"a {stages}-stage cut"
        cut.require_plan(plan, what, cut.every_pipeline_has(stages), names)
        assert plan is not None
        ours = figures(mesh, reference, prompt_ids, long_ids, args.tokens, args.repeats)
        entry = mesh.nodes[-1].peer_id  # the client's gateway
        order = {n.peer_id: i for i, n in enumerate(mesh.nodes)}
    return {
        "figures": ours,
        "plan": cut.describe(plan, names),
        "plan_decode_ms": [round(p.decode_latency_s * 1e3, 2) for p in plan.pipelines],
        # each stage's predicted decode step: a cut goes by the nodes' measured speeds
        "plan_stage_ms": [
            [round(s.decode_step_s * 1e3, 2) for s in p.stages] for p in plan.pipelines
        ],
        "gateway_holds_a_pipeline": any(p.peers == {entry} for p in plan.pipelines),
        # which stage of the first pipeline the client's gateway node holds (None: none):
        # peer ids are new each run, so the planner's order (and the hops a token takes
        # through the gateway's process) differ from run to run
        "gateway_stage": next(
            (i for i, s in enumerate(plan.pipelines[0].stages) if s.peer_id == entry), None
        ),
        "stages": max(cut.stages_of(plan)),
        # each stage of the first pipeline: its node's busiest thread's CPU a token of one
        # stream (its forwards, the sends and reads around them), its other threads', and
        # the busiest's wait for a core (ms): beside plan_stage_ms and the token's period,
        # where a cut's time goes
        "stage_cpu_ms": [ours["node_cpu_ms"][order[s.peer_id]] for s in plan.pipelines[0].stages],
        # the same over the 8 concurrent streams, a token of all of them: the busiest is
        # the device thread running the stage's rounds; the sum over the stages against
        # the tokens' period (1 / tokens_per_s_8) on two cores says how busy the cores were
        "stage_cpu_ms_8": [
            ours["node_cpu_ms_8"][order[s.peer_id]] for s in plan.pipelines[0].stages
        ],
        "node_memory_bytes": int(cut.option(node_args, "--max-memory", "0")),
    }


def keys(layout: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A layout's figures under ``prefix`` (replicas: today's names, split: ``split_``)."""
    ours = layout["figures"]
    short = prefix == "split_"
    return {
        f"{prefix}decode_tokens_per_s_mesh": 1.0 / ours["tpot_s"],
        f"{prefix}decode_tokens_per_s_reference": 1.0 / ours["reference_tpot_s"],
        f"{prefix}{'decode_ratio' if short else 'decode_ratio_single_stream'}": (
            ours["reference_tpot_s"] / ours["tpot_s"]
        ),
        f"{prefix}ttft_512_s_mesh": ours["ttft_512_s"],
        f"{prefix}ttft_512_s_reference": ours["reference_ttft_512_s"],
        f"{prefix}ttft_ratio_512": ours["ttft_512_s"] / ours["reference_ttft_512_s"],
        f"{prefix}tokens_per_s_1_stream": ours["tokens_per_s_1"],
        f"{prefix}tokens_per_s_8_streams": ours["tokens_per_s_8"],
        f"{prefix}concurrency_gain_8": ours["tokens_per_s_8"] / ours["tokens_per_s_1"],
        f"{prefix}outputs_identical": bool(ours["outputs_identical"]),
        # the settled plan: each pipeline's stages (node, start, end); the client's
        # gateway is the last node, and a pipeline all on it needs no hop
        f"{prefix}plan": layout["plan"],
        f"{prefix}plan_decode_ms": layout["plan_decode_ms"],
        f"{prefix}plan_stage_ms": layout["plan_stage_ms"],
        f"{prefix}gateway_holds_a_pipeline": layout["gateway_holds_a_pipeline"],
        f"{prefix}gateway_stage": layout["gateway_stage"],
        f"{prefix}stages": layout["stages"],
        f"{prefix}stage_cpu_ms": layout["stage_cpu_ms"],
        f"{prefix}stage_cpu_ms_8": layout["stage_cpu_ms_8"],
        # the reference's CPU a token, ms (its forward and sampling, one thread)
        f"{prefix}reference_cpu_ms": round(ours["reference_cpu_ms"], 3),
        # the client's (this process's) CPU a token of those streams, ms
        f"{prefix}client_cpu_ms": round(ours["client_cpu_ms"], 3),
        f"{prefix}client_cpu_ms_8": round(ours["client_cpu_ms_8"], 3),
        f"{prefix}node_memory_bytes": layout["node_memory_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=64)
    # five: on a shared VM one repeat in three may run 10-15 % off on either side (per-repeat
    # ratios of 0.86-1.06 in one quiet minute, docs/benchmarks.md); the median of five holds
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--weights",
        default="native",
        help="weight format of every node and the reference (native: as the model ships)",
    )
    parser.add_argument(
        "--stages",
        type=int,
        default=3,
        help="the split layout's stage count, forced by memory caps (0: no split layout)",
    )
    parser.add_argument(
        "--no-replicas", action="store_true", help="skip the whole-model replicas layout"
    )
    parser.add_argument("--model", default=None, help="the model to serve (default: hetmesh's)")
    parser.add_argument("--prefix", default="", help="prepended to every key (synth1b_…)")
    parser.add_argument(
        "--no-synth1b",
        action="store_true",
        help=f"skip the split layout of {SYNTH1B} (run with the default model only)",
    )
    parser.add_argument(
        "--no-single-process",
        action="store_true",
        help="skip bench/decode.py's single-process speedup",
    )
    args = parser.parse_args()
    if args.stages == 1 or args.stages < 0:
        parser.error("--stages is 2 or more (0: no split layout; the replicas are 1 stage)")

    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=True)
    filler = encode_prompt(tokenizer, "The sea is wide and the night is long. " * 80)
    long_ids = filler[:512]
    base = Reference(model_dir, args.weights)
    result: dict[str, Any] = {"tokens": args.tokens, "repeats": args.repeats}
    result["weights"] = args.weights
    # the nodes inherit this environment: which fast paths ran (for A/B records)
    result["fast_path_switches"] = {name: os.environ.get(name, "") for name in FAST_PATHS}
    if not args.no_replicas:
        replicas = run_layout(model_dir, base, 1, args, prompt_ids, long_ids)
        result.update(keys(replicas, ""))
        result["replicas_stages"] = result.pop("stages")
        result["replicas_node_memory_bytes"] = result.pop("node_memory_bytes")
    if args.stages:
        result.update(
            keys(run_layout(model_dir, base, args.stages, args, prompt_ids, long_ids), "split_")
        )
    del base
    if args.stages and args.model is None and not args.no_synth1b:
        result.update(synth1b(args))
    if not args.no_single_process:
        import decode  # bench/decode.py, beside this file

        single = decode.measure(model_dir, prompt_ids, tokens=args.tokens, repeats=args.repeats)
        result.update(
            {k: v for k, v in single.items() if k.startswith(("single_", "fused_", "float32_"))}
        )
    if args.prefix:
        result = {f"{args.prefix}{k}": v for k, v in result.items()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    report(result, args.prefix)


SYNTH1B = "synth-llama-3.2-1b"


def synth1b(args: argparse.Namespace) -> dict[str, Any]:
    """The split layout of :data:`SYNTH1B` against its own single process: ``synth1b_split_*``
    (``synth1b_skipped`` where the checkpoint is not on this machine)."""
    from hetmesh.errors import MeshError
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt, load_tokenizer

    try:
        model_dir = resolve_model(SYNTH1B)
    except (MeshError, OSError) as exc:
        return {"synth1b_skipped": f"{SYNTH1B} is not here: {exc}"}
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=True)
    long_ids = encode_prompt(tokenizer, "The sea is wide and the night is long. " * 80)[:512]
    reference = Reference(model_dir, args.weights)
    layout = run_layout(model_dir, reference, args.stages, args, prompt_ids, long_ids)
    return {f"synth1b_{k}": v for k, v in keys(layout, "split_").items()}


def report(result: dict[str, Any], prefix: str) -> None:
    """The figures as text, one layout after the other."""
    layouts = [("replicas", f"{prefix}", "decode_ratio_single_stream")]
    layouts.append(("split", f"{prefix}split_", "decode_ratio"))
    layouts.append((f"split, {SYNTH1B}", f"{prefix}synth1b_split_", "decode_ratio"))
    for label, at, ratio in layouts:
        if f"{at}ttft_ratio_512" not in result:
            continue
        predicted = result[f"{at}plan_decode_ms"]
        print(f"{label}: plan {result[f'{at}plan']} (predicted {predicted} ms a token)")
        print(
            f"  decode, one stream     mesh {result[f'{at}decode_tokens_per_s_mesh']:.1f} tok/s, "
            f"reference {result[f'{at}decode_tokens_per_s_reference']:.1f} tok/s, "
            f"ratio {result[f'{at}{ratio}']:.2f}"
        )
        print(
            f"  TTFT, 512-token prompt mesh {result[f'{at}ttft_512_s_mesh'] * 1e3:.0f} ms, "
            f"reference {result[f'{at}ttft_512_s_reference'] * 1e3:.0f} ms, "
            f"ratio {result[f'{at}ttft_ratio_512']:.2f}"
        )
        print(
            f"  8 streams vs 1         {result[f'{at}tokens_per_s_8_streams']:.1f} vs "
            f"{result[f'{at}tokens_per_s_1_stream']:.1f} tok/s, "
            f"gain {result[f'{at}concurrency_gain_8']:.2f}"
        )
        print(f"  outputs identical to the reference: {result[f'{at}outputs_identical']}")
    if f"{prefix}single_process_speedup" in result:
        print(
            f"single process           {result[f'{prefix}single_process_tokens_per_s']:.1f} vs "
            f"{result[f'{prefix}single_process_tokens_per_s_old']:.1f} tok/s before issue 16 "
            f"({result[f'{prefix}single_process_weights']} against fp32), "
            f"speedup {result[f'{prefix}single_process_speedup']:.2f} (target >= 2)"
        )


if __name__ == "__main__":
    main()
