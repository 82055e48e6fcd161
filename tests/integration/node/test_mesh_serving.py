"""Three node processes serve SmolLM2 split by the planner, exactly as one process does."""

from __future__ import annotations

import pytest
from mesh_nodes import (
    encode,
    generate_ids,
    reference_ids,
    running_mesh,
    view_of,
    wait_serving,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory, default_model_dir):
    with running_mesh(tmp_path_factory.mktemp("mesh3"), 3) as nodes:
        wait_serving(nodes[0])
        yield nodes


async def test_three_nodes_split_the_model_and_match_the_reference(mesh3, default_model_dir):
    view = await view_of(mesh3[0])
    stages = sorted(
        (s["start"], s["end"], p["peer_id"]) for p in view["peers"] for s in p["record"]["stages"]
    )
    assert len({peer for _, _, peer in stages}) == 3  # every node holds a part
    bounds = [0] + [b for _, b, _ in stages]
    assert [a for a, _, _ in stages] == bounds[:-1]  # contiguous from unit 0 ...
    assert bounds[-1] == 32  # ... to the end: embedding + 30 layers + head
    for i, prompt in enumerate(PROMPTS):
        ids = encode(default_model_dir, prompt)
        gateway = mesh3[i % 3].addr  # requests may enter at any node
        got = await generate_ids(gateway, ids, max_new_tokens=20)
        assert got == reference_ids(default_model_dir, ids, 20), prompt
