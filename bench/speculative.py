"""Speculative decoding on a 3-stage cut, over a WAN and over cheap hops (issue 48; root).

``python bench/speculative.py [--json]`` cuts the default model (float32) into
three stages (``bench/cut.py``: memory caps that make three nodes needed; the
run fails if the adopted plan has another shape) over three emulated hosts
(``hetmesh/testbed``). Two networks:

- ``wan``: every host's access link holds each frame 5 ms each way
  (``HostSpec.delay_s``; the kernel has no ``netem``, see
  ``hetmesh/testbed/delay.py``), so any two hosts are 20 ms apart in round trip
  and a token crosses three hops;
- ``loopback``: the same hosts with plain links (a bridge: ~0.06 ms).

On each network, fresh meshes of real node processes with the same format and
threads, one per arm, in order (``--rounds 2`` runs the arms again, reversed:
A/B/B/A):

- ``off``: ``--no-speculative`` (plain decoding);
- ``default``: no flag, the node as shipped (the same as ``lookup_measured``);
- ``lookup``: ``--speculative-k K`` (prompt lookup, K drafts every step);
- ``lookup_measured``: ``--speculative`` (prompt lookup, the measured budget:
  :class:`~hetmesh.speculative.budget.SpeculationBudget`, up to 8 a step);
- ``draft``: ``--speculative --draft int4`` (an int4 copy of the model at the
  gateway drafting for the float32 mesh, the measured budget); ``draft_fixed``:
  ``--speculative-k K --draft int4``.

Each mesh answers the copy-heavy prompts (rewrite or repeat a given passage) and
the open ones (a story, an explanation), greedy, ``--tokens`` each, entering at
host 0. A generation's rate is ``(n - 1) ÷`` the time from its first token to
its last; an arm's rate on a prompt set is the median over its generations.

``--json`` prints one object: ``wan_repetitive_speedup`` (lookup_measured ÷ off,
copy-heavy prompts; target ≥ 2.5), ``wan_open_speedup`` (draft ÷ off, open
prompts; ≥ 1.3), ``loopback_open_speedup`` (draft ÷ off on the loopback; ≥ 0.95),
the same for the other arms (``*_fixed_k``: the node's own fixed K),
``outputs_identical`` (every stream of every arm equal to the single-process
float32 reference), ``plan`` and ``split_stages`` (3), the gateway's counters per
arm (drafted, accepted, tokens per verify step), each arm's rates, the CPU model
and the load. ``offline`` replays the reference streams through the drafters in
this process (no mesh): the drafts each would have had kept, i.e. the ceiling of
tokens per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the "
    "island itself. For ninety years its lamp burned paraffin, and the keepers carried the "
    "fuel up one hundred and twelve steps every evening. In 1961 the light was electrified, "
    "and in 1989 the last keeper left; since then the lamp has been switched on and off by "
    "a timer, and the keepers' cottage has become a small museum that opens in the summer "
    "months."
)
REPETITIVE = (
    f"Rewrite the following passage in plain English, keeping every fact:\n\n{PASSAGE}",
    f"Repeat the following passage word for word:\n\n{PASSAGE}",
)
OPEN = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
)
STAGES = 3
WAN_RTT_S = 0.020
NODE_ARGS = ("--max-sessions", "4", "--max-context", "1024", "--weights", "float32")
MEASURED_MAX_K = 8  # hetmesh.node.config.DEFAULT_SPECULATIVE_K: the measured budget's most
# arm -> its nodes' flags; "K": the fixed arms' --k
ARMS: dict[str, tuple[str, ...]] = {
    "off": ("--no-speculative",),
    "default": (),  # no flag: the node as shipped (prompt lookup, the measured budget)
    "lookup": ("--speculative-k", "K"),  # prompt lookup, K drafts every step
    "lookup_measured": ("--speculative",),  # prompt lookup, the measured budget
    "draft": ("--speculative", "--draft", "int4"),  # int4 self-draft, the measured budget
    "draft_fixed": ("--speculative-k", "K", "--draft", "int4"),
}
DEFAULT_ARMS = "off,lookup,lookup_measured,draft"
# the gateway's speculation counters in its status record (hetmesh.node.gateway_records)
COUNTERS = ("verify_steps", "drafted", "accepted", "verified_tokens")


class Drafter(Protocol):
    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


# -- pure parts --------------------------------------------------------------------


def replay(
    prompt: Sequence[int], stream: Sequence[int], drafter: Drafter, k: int
) -> dict[str, int]:
    """Steps a greedy ``stream`` would take with ``k`` drafts from ``drafter`` a step:
    each step keeps the drafts that agree with the stream, then the stream's own token."""
    pos = steps = drafted = kept = 0
    history = list(prompt)
    while pos < len(stream):
        drafts = drafter.propose(history, k)[:k]
        m = 0
        while m < len(drafts) and pos + m < len(stream) and drafts[m] == stream[pos + m]:
            m += 1
        step = list(stream[pos : pos + m + 1])
        history += step
        pos += len(step)
        steps += 1
        drafted += len(drafts)
        kept += m
    return {"steps": steps, "drafted": drafted, "accepted": kept, "tokens": len(stream)}


def decode_rate(times_s: Sequence[float]) -> float | None:
    """Tokens a second from the first token to the last (None: fewer than two)."""
    if len(times_s) < 2 or times_s[-1] <= times_s[0]:
        return None
    return (len(times_s) - 1) / (times_s[-1] - times_s[0])


def median_rate(generations: Sequence[dict[str, Any]]) -> float | None:
    rates = [r for g in generations if (r := decode_rate(g.get("times_s") or ())) is not None]
    return statistics.median(rates) if rates else None


def ratio(on: float | None, off: float | None) -> float | None:
    if on is None or not off:
        return None
    return round(on / off, 3)


def counters_of(view: Any) -> dict[str, int]:
    """The speculation counters summed over a status view (any depth: each gateway's)."""
    found = dict.fromkeys(COUNTERS, 0)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "verified_tokens" in node and "drafted" in node:
                for key in COUNTERS:
                    value = node.get(key)
                    if isinstance(value, int) and not isinstance(value, bool):
                        found[key] += value
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(view)
    return found


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {key: after[key] - before.get(key, 0) for key in COUNTERS}
    steps = out["verify_steps"]
    out["tokens_per_verify_step"] = round(out["verified_tokens"] / steps, 2) if steps else None
    out["acceptance"] = round(out["accepted"] / out["drafted"], 3) if out["drafted"] else None
    return out


def arm_order(arms: Sequence[str], rounds: int) -> list[str]:
    """``arms`` in order, then reversed, ``rounds`` times (A/B/B/A: drift cancels)."""
    order: list[str] = []
    for r in range(rounds):
        order += list(arms) if r % 2 == 0 else list(reversed(arms))
    return order


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- the run -----------------------------------------------------------------------


def arm_args(arm: str, k: str) -> list[str]:
    """The node flags of ``arm``, ``K`` replaced by ``k``."""
    return [k if a == "K" else a for a in ARMS[arm]]


def measure_arm(
    bed: Any,
    model_dir: Path,
    arm: str,
    args: argparse.Namespace,
    prompts: dict[str, list[list[int]]],
) -> dict[str, Any]:
    """One fresh mesh for ``arm``: its plan checked, each prompt set's streams."""
    import cut  # bench/cut.py, beside this file

    from hetmesh.testbed.mesh import plan_of

    tokens, repeat = args.tokens, args.repeat
    node_args = cut.node_args_for(model_dir, STAGES, [*NODE_ARGS, *arm_args(arm, args.k)])
    began = time.monotonic()
    bed.start_all(*node_args)
    try:
        view = bed.wait_serving()
        plan = plan_of(view)
        names = {p: f"host{h}" for p, h in bed.peer_host().items()}
        cut.require_plan(plan, f"a {STAGES}-stage cut", cut.every_pipeline_has(STAGES), names)
        up_s = time.monotonic() - began
        bed.generate(prompts["open"][0], 4)  # warm-up: links opened, caches touched
        before = counters_of(bed.status())
        out: dict[str, Any] = {"plan": cut.describe(plan, names), "mesh_up_s": round(up_s, 1)}
        for name, ids_list in prompts.items():
            gens: list[dict[str, Any]] = []
            for ids in ids_list:
                got = bed.generate(ids, tokens, repeat=repeat)
                failed = [g for g in got if "tokens" not in g]
                if failed:
                    raise RuntimeError(f"{arm}: generation failed: {failed[0]}")
                gens += got
            out[name] = {
                "tokens_per_s": median_rate(gens),
                "streams": [g["tokens"] for g in gens],
            }
        out["counters"] = counters_delta(before, counters_of(bed.status()))
        out["stages"] = max(cut.stages_of(plan))
        return out
    finally:
        bed.stop_nodes()


def run_network(
    name: str,
    delay_s: float | None,
    arms: Sequence[str],
    args: argparse.Namespace,
    model_dir: Path,
    prompts: dict[str, list[list[int]]],
) -> dict[str, list[dict[str, Any]]]:
    from hetmesh.testbed.mesh import HostSpec, open_mesh_testbed

    workdir = Path(tempfile.mkdtemp(prefix=f"hetmesh-spec-{name}-"))
    hosts = [HostSpec(delay_s=delay_s) for _ in range(STAGES)]
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with open_mesh_testbed(workdir, hosts) as bed:
        for arm in arm_order(list(arms), args.rounds):
            print(f"{name}/{arm}: starting", file=sys.stderr, flush=True)
            r = measure_arm(bed, model_dir, arm, args, prompts)
            print(
                f"{name}/{arm}: plan {r['plan']}, "
                + ", ".join(f"{k} {r[k]['tokens_per_s']}" for k in prompts)
                + f" tokens/s, {r['counters']}",
                file=sys.stderr,
                flush=True,
            )
            results[arm].append(r)
    return results


def arm_rate(runs: list[dict[str, Any]], prompt_set: str) -> float | None:
    rates = [r[prompt_set]["tokens_per_s"] for r in runs if r[prompt_set]["tokens_per_s"]]
    return statistics.median(rates) if rates else None


def offline(
    model_dir: Path, prompts: dict[str, list[list[int]]], refs: dict[str, list[list[int]]], k: int
) -> dict[str, Any]:
    """The reference streams replayed through prompt lookup and the int4 draft model."""
    from hetmesh.speculative.draft_model import DraftModel

    drafters: dict[str, Any] = {"int4_draft": DraftModel.load(model_dir)}
    try:
        from hetmesh.speculative.lookup import PromptLookup

        drafters["lookup"] = PromptLookup
    except ImportError:  # the mesh path's drafter is not in this checkout
        pass
    out: dict[str, Any] = {}
    for name, make in drafters.items():
        for prompt_set, ids_list in prompts.items():
            total = dict.fromkeys(("steps", "drafted", "accepted", "tokens"), 0)
            for ids, stream in zip(ids_list, refs[prompt_set], strict=True):
                drafter = make.drafter() if name == "int4_draft" else make()
                try:
                    for key, value in replay(ids, stream, drafter, k).items():
                        total[key] += value
                finally:
                    drafter.close()
            total["tokens_per_step"] = round(total["tokens"] / max(1, total["steps"]), 2)  # type: ignore[assignment]
            out[f"{name}_{prompt_set}"] = total
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="generations per prompt")
    parser.add_argument("--rounds", type=int, default=1, help="2: the arms again, reversed")
    parser.add_argument("--k", default="4", help="drafts a step of the fixed arms")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"of {','.join(ARMS)}")
    parser.add_argument("--networks", default="wan,loopback")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument(
        "--offline-only", action="store_true", help="the replay alone: no testbed, no mesh"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from hetmesh.testbed.mesh import why_no_testbed

    why = None if args.offline_only else why_no_testbed()
    if why:  # fail, not skip: the figures need the testbed
        print(f"cannot build the testbed here: {why}", file=sys.stderr)
        return 2
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.store import resolve_model
    from hetmesh.partition.text import encode_prompt
    from hetmesh.protocol.generate import SamplingParams

    began, load_before = time.monotonic(), os.getloadavg()[0]
    model_dir = resolve_model()
    reference = LocalPipeline.load(model_dir, 1, weights="float32")
    tok = reference.tokenizer
    prompts = {
        "repetitive": [encode_prompt(tok, p, chat=True) for p in REPETITIVE],
        "open": [encode_prompt(tok, p, chat=True) for p in OPEN],
    }
    params = SamplingParams(max_new_tokens=args.tokens)
    refs = {
        name: [list(reference.generate_ids(ids, params)) for ids in ids_list]
        for name, ids_list in prompts.items()
    }
    del reference
    k_offline = int(args.k) if args.k.isdigit() else 4
    if args.offline_only:
        print(json.dumps({"offline": offline(model_dir, prompts, refs, k_offline), "k": args.k}))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown or "off" not in arms:
        parser.error(f"--arms: unknown {sorted(unknown)}, or no 'off' to compare with")
    delays = {"wan": WAN_RTT_S / 4, "loopback": None}  # 4 waits per round trip
    results: dict[str, Any] = {}
    for network in args.networks.split(","):
        results[network] = run_network(network, delays[network], arms, args, model_dir, prompts)

    def speedup(network: str, arm: str, prompt_set: str) -> float | None:
        runs = results.get(network)
        if not runs or arm not in runs:
            return None
        return ratio(arm_rate(runs[arm], prompt_set), arm_rate(runs["off"], prompt_set))

    streams_equal = [
        run[prompt_set]["streams"] == [s for s in refs[prompt_set] for _ in range(args.repeat)]
        for arms in results.values()
        for runs in arms.values()
        for run in runs
        for prompt_set in prompts
    ]
    any_run = next(run for arms in results.values() for runs in arms.values() for run in runs)
    out: dict[str, Any] = {
        "wan_repetitive_speedup": speedup("wan", "lookup_measured", "repetitive"),
        "wan_open_speedup": speedup("wan", "draft", "open"),
        "loopback_open_speedup": speedup("loopback", "draft", "open"),
        "loopback_repetitive_speedup": speedup("loopback", "lookup_measured", "repetitive"),
        "wan_repetitive_speedup_fixed_k": speedup("wan", "lookup", "repetitive"),
        "wan_open_speedup_fixed_k": speedup("wan", "draft_fixed", "open"),
        "loopback_open_speedup_fixed_k": speedup("loopback", "draft_fixed", "open"),
        "loopback_repetitive_speedup_fixed_k": speedup("loopback", "lookup", "repetitive"),
        "speedups": {
            f"{network}_{arm}_{p}": speedup(network, arm, p)
            for network in results
            for arm in arms
            if arm != "off"
            for p in prompts
        },
        "outputs_identical": int(all(streams_equal)),
        "plan": any_run["plan"],
        "split_stages": any_run["stages"],
        "k": args.k,
        "max_k": MEASURED_MAX_K,
        "wan_rtt_ms": WAN_RTT_S * 1e3,
        "arms": {
            network: {
                arm: [
                    {
                        "tokens_per_s": {p: run[p]["tokens_per_s"] for p in prompts},
                        "counters": run["counters"],
                        "plan": run["plan"],
                        "mesh_up_s": run["mesh_up_s"],
                    }
                    for run in runs
                ]
                for arm, runs in arms.items()
            }
            for network, arms in results.items()
        },
        "tokens": args.tokens,
        "threads": 1,  # every node: --threads 1 (hetmesh/testbed/mesh.py)
        "weights": "float32",
        "cpu_model": cpu_model(),
        "seconds": round(time.monotonic() - began, 1),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if not args.no_offline:
        out["offline"] = offline(model_dir, prompts, refs, k_offline)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0 if out["outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
