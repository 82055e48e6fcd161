"""KVManager with the prefix cache: admission counts attached blocks, hit rate, no leak."""

from __future__ import annotations

import torch

from hetmesh.node.kvcache import KVLimits, KVManager
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.prefix import block_hashes


def make(blocks: int = 10) -> tuple[KVManager[SessionKV], KVPool]:
    pool = KVPool(
        num_blocks=blocks,
        num_layers=1,
        kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    limits = KVLimits(max_sessions=8, max_tokens_per_session=160, budget_bytes=1, reserve_blocks=1)
    manager = KVManager(
        limits, pool=pool, factory=lambda: SessionKV(owner=0, pool=pool, max_length=160)
    )
    return manager, pool


def prefill(kv: SessionKV, tokens: int) -> None:
    """What a forward does to the table: room for ``tokens`` more, then committed."""
    kv._reserve(tokens)
    kv._commit(tokens)


def test_a_shared_prompt_needs_only_its_own_blocks_and_counts_as_a_hit():
    manager, pool = make(blocks=10)
    ids = list(range(70))  # 4 full blocks + 6 tokens
    hashes = block_hashes(ids)
    first = manager.open("a", 160, len(ids), hashes)
    assert first.length == 0  # nothing cached yet: prefill from the start
    prefill(first, len(ids))
    first.publish(hashes)
    second = manager.open("b", 160, len(ids), hashes)
    assert second.length == 64  # four shared blocks; the 6-token tail is its own
    assert second.blocks[:4] == first.blocks[:4]
    assert pool.free_blocks == 10 - 5 - 1  # a: 5 blocks, b: only its tail's
    stats = manager.statistics()
    assert stats.prefix_queried_tokens == 2 * 64
    assert stats.prefix_hit_tokens == 64
    assert stats.prefix_hit_rate == 0.5
    assert stats.blocks_cached == 4
    assert stats.blocks_in_use == 6
    manager.close("a")
    manager.close("b")
    stats = manager.statistics()
    assert (stats.blocks_free, stats.blocks_cached) == (10, 4)  # idle cached blocks count free


def test_a_prompt_of_whole_blocks_still_feeds_its_last_token():
    manager, _ = make()
    ids = list(range(32))
    kv = manager.open("a", 160, 32, block_hashes(ids))
    prefill(kv, 32)
    kv.publish(block_hashes(ids))
    again = manager.open("b", 160, 32, block_hashes(ids))
    assert again.length == 16  # the second block holds the last token: it is recomputed


def test_preempting_a_sharer_keeps_the_shared_blocks_for_the_others():
    manager, pool = make(blocks=6)
    ids = list(range(40))
    hashes = block_hashes(ids)
    a = manager.open("a", 96, 40, hashes)
    prefill(a, 40)
    a.publish(hashes)
    b = manager.open("b", 96, 40, hashes)
    assert b.length == 32
    prefill(b, 8)
    assert pool.free_blocks == 2  # a: 3 blocks, b: one of its own
    assert manager.grow("a", 96) == ["b"]  # a needs 3 more: b, the newest, goes
    assert a.capacity == 96
    assert a.length == 40
    manager.close("a")
    assert pool.free_blocks == 6
    assert manager.statistics().preempted == 1
