"""Node processes serving compact weights split the model and match one process in that format.

One mesh per format, shared by its tests and started beside the other: two
nodes whose memory cap makes the planner split the model, both started with
``--weights F``. The mesh's greedy tokens must equal ``LocalPipeline``
holding the whole model in ``F``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mesh_nodes import (  # NodeFactory: the discovery tests' process helper
    SERVE_ARGS,
    NodeFactory,
    NodeProc,
    encode,
    generate_ids,
    view_of,
    wait_serving,
)

from hetmesh.partition.sampling import SamplingParams

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16
# Per node: under what one node needs for the whole model in bf16 or int8 with
# its KV budget (~470 and ~390 MiB at 512 tokens × 4 sessions, reserve included),
# so the planner must use both; the announced block step skips the start-up
# calibration (its figure does not change what these tests check).
CAPS = {"bfloat16": "400MiB", "int8": "350MiB"}

_REFERENCES: dict[str, Any] = {}


def reference_ids(model_dir: Path, weights: str, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of one process holding the whole model in ``weights``."""
    from hetmesh.partition.generate import LocalPipeline

    torch.set_num_threads(1)
    pipeline = _REFERENCES.get(weights)
    if pipeline is None:
        pipeline = _REFERENCES[weights] = LocalPipeline.load(model_dir, 1, weights=weights)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    return list(pipeline.generate_ids(prompt_ids, params))


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, default_model_dir) -> Iterator[dict[str, list[NodeProc]]]:
    """One two-node mesh per format, started side by side (their start-ups overlap)."""
    factory = NodeFactory(tmp_path_factory.mktemp("mesh-weights"))
    try:

        def args(weights: str) -> tuple[str, ...]:
            return (
                *SERVE_ARGS,
                *("--weights", weights, "--max-memory", CAPS[weights]),
                *("--max-context", "512", "--block-step-ms", "2"),
            )

        # each mesh's second node bootstraps only to its first: the meshes never meet
        firsts = {w: factory.start(*args(w), name=f"{w}-0") for w in CAPS}
        # and a lone node choosing its format, too small to be given any stage
        auto = factory.start(
            *SERVE_ARGS,
            *("--weights", "auto", "--max-memory", "120MiB", "--max-context", "512"),
            name="auto",
        )
        for node in firsts.values():
            node.wait_ready(120)
        seconds = {
            w: factory.start(*args(w), "--bootstrap", firsts[w].addr, name=f"{w}-1") for w in CAPS
        }
        out = {w: [firsts[w], seconds[w].wait_ready(120)] for w in CAPS}
        for nodes in out.values():
            wait_serving(nodes[0], timeout_s=240)
        out["auto"] = [auto.wait_ready(120)]
        yield out
    finally:
        factory.close()


@pytest.fixture(params=sorted(CAPS))
def mesh(request, meshes) -> tuple[str, list[NodeProc]]:
    return request.param, meshes[request.param]


async def test_the_mesh_matches_one_process_in_the_same_format(mesh, default_model_dir):
    weights, nodes = mesh
    view = await view_of(nodes[0])
    held = {
        p["peer_id"]: [(s["start"], s["end"]) for s in p["record"]["stages"]] for p in view["peers"]
    }
    assert all(held.values()), held  # both nodes hold a part: the model was split
    announced = {p["record"]["extra"].get("weights") for p in view["peers"]}
    assert announced == {weights}
    for i, prompt in enumerate(PROMPTS):
        ids = encode(default_model_dir, prompt)
        got = await generate_ids(nodes[i % 2].addr, ids, max_new_tokens=NEW_TOKENS)
        assert got == reference_ids(default_model_dir, weights, ids), (weights, prompt)


async def test_the_plan_says_every_stage_holds_the_mesh_format(mesh):
    from hetmesh.cli.status_view import summarize

    weights, nodes = mesh
    summary = summarize(await view_of(nodes[1]))
    stages = [s for p in summary["plan"]["pipelines"] for s in p["stages"]]
    assert len(stages) >= 2
    assert {s["weights"] for s in stages} == {weights}
    assert {p["weights"] for p in summary["load"]["peers"]} == {weights}


def test_auto_announces_the_format_its_calibration_timed(meshes):
    from mesh_nodes import fetch_view, wait_for

    (node,) = meshes["auto"]

    def announced() -> dict[str, Any] | None:
        (me,) = [p for p in fetch_view(node.addr)["peers"] if p["health"] == "self"]
        extra = me["record"]["extra"]
        return extra if extra.get("weights") and extra.get("calibration") else None

    extra = wait_for(announced, 120, "the auto node to announce its format", every_s=0.5)
    # the block step announced is the chosen format's, measured (not the given 2 ms)
    assert extra["calibration"]["weights"] == extra["weights"]
    assert extra["calibration"]["block_step_s"] != pytest.approx(2e-3)
    assert extra["weights"] in ("float32", "bfloat16", "int8")
    assert "weights auto:" in node.log()
