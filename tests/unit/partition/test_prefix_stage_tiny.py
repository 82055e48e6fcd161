"""A prompt that starts from cached blocks gives the logits of a full prefill (tiny models)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hetmesh.partition.prefix import block_hashes
from hetmesh.partition.stage import load_stage
from tests.unit.partition.tiny_models import FAMILIES, VOCAB, reference_logits, save_tiny

ATOL = 1e-4


# a plain model and one whose sliding window is shorter than the shared prefix
@pytest.fixture(scope="module", params=[FAMILIES[0], "mistral-window"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny(request.param, folder)


def test_a_shared_prefix_is_not_recomputed_and_changes_no_logit(tiny: Any) -> None:
    folder, model = tiny
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(4, VOCAB, (37,), generator=gen)  # 2 full blocks + 5 tokens
    first = torch.cat([system, torch.randint(4, VOCAB, (6,), generator=gen)])
    second = torch.cat([system, torch.randint(4, VOCAB, (9,), generator=gen)])
    stages = [load_stage(folder, 0, 3), load_stage(folder, 3, 6)]
    pools = [s.new_pool(16) for s in stages]

    kvs = [s.new_kv(p) for s, p in zip(stages, pools, strict=True)]
    x = first
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
        kv.publish(block_hashes(first.tolist()))
        kv.free()  # the first request is over; its full blocks stay cached
    assert [p.cached_blocks for p in pools] == [2, 2]

    hashes = block_hashes(second.tolist())
    kvs = [s.new_kv(p) for s, p in zip(stages, pools, strict=True)]
    starts = [kv.attach(hashes, len(second) - 1) for kv in kvs]
    assert starts == [32, 32]  # both system-prompt blocks, on every stage
    x = second[32:]  # only the uncached tail is computed
    for stage, kv in zip(stages, kvs, strict=True):
        x = stage.forward(x, kv)
    ref, steps = reference_logits(model, second, [5, 9])
    torch.testing.assert_close(x, ref[32:], atol=ATOL, rtol=0)
    for token, expected in zip([5, 9], steps, strict=True):  # decoding on top of shared blocks
        x = torch.tensor([token])
        for stage, kv in zip(stages, kvs, strict=True):
            x = stage.forward(x, kv)
        torch.testing.assert_close(x[-1], expected, atol=ATOL, rtol=0)
    for kv in kvs:
        kv.free()
    assert [p.free_blocks for p in pools] == [16, 16]
