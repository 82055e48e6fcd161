"""Node processes serving compact weights split the model and match one process in their formats.

A float16 + int8 mesh and a bf16 + int4 mesh, started side by side and shared
by the tests: two nodes each, whose memory caps make the planner split the
model, so the four compact formats are each served by a mesh (float32 is by all
the other mesh tests). A mesh must give the greedy tokens of one process
holding each stage of its plan in that stage's format (the plan says which);
where all its nodes serve one format F, of ``LocalPipeline`` holding the whole
model in F.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetmesh.partition.sampling import SamplingParams
from tests.integration.node.mesh_nodes import (  # NodeFactory: the discovery tests' process helper
    SERVE_ARGS,
    NodeFactory,
    NodeProc,
    encode,
    generate_ids,
    view_of,
    wait_serving,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16
# (weights, --max-memory) of each mesh's two nodes. Each cap is under what one
# node needs for the whole model in its format with its KV budget (~375 MiB in
# bf16 or float16; ~247 MiB in int8 and ~209 MiB in int4, whose KV is fp16, at
# 512 tokens × 4 sessions, reserve included: hetmesh.scheduler.caps), so the
# planner must use both nodes.
# Two mixed meshes cover the four compact formats (each mesh costs its start-up). The announced
# block step skips the start-up calibration (its figure does not change what these
# tests check).
MESHES = {
    "float16+int8": (("float16", "250MiB"), ("int8", "200MiB")),
    "bfloat16+int4": (("bfloat16", "250MiB"), ("int4", "180MiB")),
}

_STAGES: dict[tuple[int, int, str], Any] = {}


def reference_ids(
    model_dir: Path, layout: list[tuple[int, int, str]], prompt_ids: list[int]
) -> list[int]:
    """Greedy tokens of one process: one stage holding the whole model where
    ``layout`` ((start, end, weights) per stage) has one format, else its stages
    chained, each in its format (the single-process twin of a mixed mesh)."""
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.stage import load_stage

    torch.set_num_threads(1)
    if len({w for _, _, w in layout}) == 1:
        layout = [(0, layout[-1][1], layout[0][2])]
    stages = []
    for start, end, weights in layout:
        if (start, end, weights) not in _STAGES:
            _STAGES[(start, end, weights)] = load_stage(model_dir, start, end, weights=weights)
        stages.append(_STAGES[(start, end, weights)])
    pipeline = LocalPipeline(stages, model_dir=model_dir)
    return list(pipeline.generate_ids(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS)))


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, default_model_dir) -> Iterator[dict[str, list[NodeProc]]]:
    """The meshes of :data:`MESHES` and a lone auto node, started side by side (their
    start-ups overlap); each mesh's second node bootstraps only to its first, so the
    meshes never meet."""
    factory = NodeFactory(tmp_path_factory.mktemp("mesh-weights"))
    try:

        def args(weights: str, cap: str) -> tuple[str, ...]:
            return (
                *SERVE_ARGS,
                *("--weights", weights, "--max-memory", cap),
                *("--max-context", "512", "--block-step-ms", "2"),
            )

        firsts = {k: factory.start(*args(*m[0]), name=f"{k}-0") for k, m in MESHES.items()}
        # a node choosing its format, too small to be given any stage
        auto = factory.start(
            *SERVE_ARGS,
            *("--weights", "auto", "--max-memory", "120MiB", "--max-context", "512"),
            name="auto",
        )
        for node in firsts.values():
            node.wait_ready(120)
        seconds = {
            k: factory.start(*args(*m[1]), "--bootstrap", firsts[k].addr, name=f"{k}-1")
            for k, m in MESHES.items()
        }
        out = {k: [firsts[k], seconds[k].wait_ready(120)] for k in MESHES}
        for nodes in out.values():
            wait_serving(nodes[0], timeout_s=240)
        out["auto"] = [auto.wait_ready(120)]
        yield out
    finally:
        factory.close()


@pytest.fixture(params=sorted(MESHES))
def mesh(request, meshes) -> tuple[str, list[NodeProc]]:
    return request.param, meshes[request.param]


async def test_the_mesh_matches_one_process_holding_the_same_formats(mesh, default_model_dir):
    from hetmesh.cli.status_view import summarize

    name, nodes = mesh
    view = await view_of(nodes[0])
    held = {
        p["peer_id"]: [(s["start"], s["end"]) for s in p["record"]["stages"]] for p in view["peers"]
    }
    assert all(held.values()), held  # both nodes hold a part: the model was split
    announced = sorted(p["record"]["extra"].get("weights") for p in view["peers"])
    assert announced == sorted(w for w, _ in MESHES[name])
    (pipeline,) = summarize(view)["plan"]["pipelines"]
    layout = [(s["start"], s["end"], s["weights"]) for s in pipeline["stages"]]
    by_peer = {p["peer_id"]: p["record"]["extra"]["weights"] for p in view["peers"]}
    # the plan says which format each stage holds: its node's
    assert [w for _, _, w in layout] == [by_peer[s["peer_id"]] for s in pipeline["stages"]]
    for i, prompt in enumerate(PROMPTS):
        ids = encode(default_model_dir, prompt)
        got = await generate_ids(nodes[i % 2].addr, ids, max_new_tokens=NEW_TOKENS)
        assert got == reference_ids(default_model_dir, layout, ids), (name, layout, prompt)


async def test_status_shows_each_peers_format(mesh):
    from hetmesh.cli.status_view import summarize

    name, nodes = mesh
    summary = summarize(await view_of(nodes[1]))
    assert sorted(p["weights"] for p in summary["load"]["peers"]) == sorted(
        w for w, _ in MESHES[name]
    )


def test_auto_announces_the_format_its_calibration_timed(meshes):
    from tests.integration.node.mesh_nodes import fetch_view, wait_for

    (node,) = meshes["auto"]

    def announced() -> dict[str, Any] | None:
        (me,) = [p for p in fetch_view(node.addr)["peers"] if p["health"] == "self"]
        extra = me["record"]["extra"]
        return extra if extra.get("weights") and extra.get("calibration") else None

    extra = wait_for(announced, 120, "the auto node to announce its format", every_s=0.5)
    # the block step announced is the chosen format's, measured (not the given 2 ms)
    assert extra["calibration"]["weights"] == extra["weights"]
    assert extra["calibration"]["block_step_s"] != pytest.approx(2e-3)
    # float16 is emulated on a CPU, so auto never times it there
    assert extra["weights"] in ("float32", "bfloat16", "int8", "int4")
    assert "weights auto:" in node.log()
