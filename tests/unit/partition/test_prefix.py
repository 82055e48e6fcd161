"""The prefix cache: chained block hashes, shared blocks, LRU of idle blocks (pure and tiny)."""

from __future__ import annotations

import random

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.prefix import PrefixCache, block_hashes


def test_block_hashes_chain_whole_blocks_only():
    ids = list(range(40))
    hashes = block_hashes(ids)
    assert len(hashes) == 2  # 40 tokens: two full blocks, a partial tail has no name
    assert hashes == block_hashes(ids[:32]) == block_hashes([*ids, 7])[:2]
    assert all(0 <= h < 2**63 for h in hashes)
    changed = block_hashes([99, *ids[1:]])  # a different first block renames every later one
    assert changed[0] != hashes[0]
    assert changed[1] != hashes[1]
    same_tail = block_hashes([99] * 16 + ids[16:32])
    assert same_tail[1] != hashes[1]  # the second block's tokens alone do not name it
    assert block_hashes(ids[:15]) == []


def test_prefix_cache_shares_then_keeps_idle_blocks_until_evicted():
    cache = PrefixCache()
    assert cache.insert(5, 111)
    assert cache.insert(6, 222)
    assert not cache.insert(9, 111)  # that prefix is cached already: block 9 stays private
    assert cache.lookup([111, 222, 333]) == [5, 6]  # the longest cached run
    assert cache.lookup([222]) == [6]  # lookups follow hashes, not positions
    assert (cache.queried_blocks, cache.hit_blocks) == (4, 3)
    # block 5: writer + one reader; block 6: writer + two readers
    for _ in range(2):
        assert cache.release(5)
    assert cache.idle_blocks == 1
    assert not cache.release(9)  # not cached: the caller frees it
    for _ in range(3):
        assert cache.release(6)
    assert cache.idle_blocks == 2
    assert cache.cached_blocks == 2
    assert cache.lookup([111]) == [5]  # reused: no longer idle
    assert cache.evict(5) == [6]  # only idle blocks go, least recently used first
    assert cache.lookup([111, 222]) == [5]
    cache.release(5)
    cache.release(5)
    with pytest.raises(ValueError, match="not held"):
        cache.release(5)


def pool(blocks: int) -> KVPool:
    return KVPool(
        num_blocks=blocks,
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def session(p: KVPool) -> SessionKV:
    return SessionKV(owner=0, pool=p, max_length=1024)


def fill(kv: SessionKV, tokens: int) -> None:
    """Write ``tokens`` tokens whose key/value is their position (as a forward would)."""
    assert kv.reserve(kv.length + tokens)
    with torch.inference_mode():
        pos = torch.arange(kv.length, kv.length + tokens, dtype=torch.float32)
        kv._write(
            0, pos[None, :, None].expand(1, tokens, 2), pos[None, :, None].expand(1, tokens, 2)
        )
    kv._commit(tokens)


def keys(kv: SessionKV) -> list[float]:
    size = kv.pool.block_tokens
    slots = [b * size + i for b in kv.blocks for i in range(size)][: kv.length]
    return kv.pool.keys[0, 0, slots, 0].tolist()


def test_a_session_attaches_the_cached_blocks_and_writes_only_after_them():
    p = pool(8)
    hashes = block_hashes(list(range(50)))  # 3 full blocks
    a = session(p)
    assert a.attach(hashes, 49) == 0  # nothing cached yet
    fill(a, 50)
    a.publish(hashes)
    assert p.cached_blocks == 3
    b = session(p)
    assert b.attach(hashes, 49) == 48  # all three full blocks, shared
    assert b.blocks == a.blocks[:3]
    assert p.free_blocks == 8 - 4
    fill(b, 5)  # its own block after the shared ones
    assert b.blocks[3] not in a.blocks
    assert keys(a) == [float(i) for i in range(50)]  # a's tokens untouched
    assert keys(b) == [float(i) for i in range(53)]
    c = session(p)
    assert c.attach(hashes, 20) == 16  # never past what the caller may skip
    c.rewind(0)  # the pipeline agreed on less: the shared block is let go
    assert c.blocks == []
    assert c.length == 0
    with pytest.raises(InvalidRequest, match="block boundary"):
        b.rewind(40)
    with pytest.raises(InvalidRequest, match="prefix cache"):
        b.truncate(40)  # would overwrite a shared block


def test_idle_cached_blocks_count_free_and_are_reused_when_the_pool_is_short():
    p = pool(4)
    hashes = block_hashes(list(range(64)))
    a = session(p)
    fill(a, 64)
    a.publish(hashes)
    a.free()
    assert p.free_blocks == 4
    assert p.cached_blocks == 4
    b = session(p)
    fill(b, 40)  # needs three blocks: the least recently used cached ones go
    assert p.cached_blocks == 1
    assert p.free_blocks == 1
    assert session(p).attach(hashes, 63) == 0  # the chain's first block was evicted
    b.free()
    assert p.free_blocks == 4


def test_no_block_leaks_over_random_shared_sessions():
    rng = random.Random(7)
    p = pool(24)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 80))] for _ in range(6)]
    live: list[SessionKV] = []
    for _ in range(300):
        if live and (rng.random() < 0.45 or p.free_blocks < 8):
            kv = live.pop(rng.randrange(len(live)))
            kv.publish(kv.hashes)  # type: ignore[attr-defined]
            kv.free()
            continue
        ids = rng.choice(prompts) + [rng.randrange(5) for _ in range(rng.randrange(3))]
        kv = session(p)
        hashes = block_hashes(ids)
        kv.hashes = hashes  # type: ignore[attr-defined]
        start = kv.attach(hashes, len(ids) - 1)
        fill(kv, len(ids) - start)
        assert keys(kv) == [float(i) for i in range(len(ids))]
        live.append(kv)
    for kv in live:
        kv.free()
    assert p.free_blocks == p.num_blocks
    assert p.allocator.free_blocks + p.prefix.idle_blocks == p.num_blocks
