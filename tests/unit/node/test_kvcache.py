"""KVManager: admission by blocks, growth, newest-first preemption, expiry (pure).

The pool is the real block allocator; the caches are table-only stand-ins for
``SessionKV`` that hold blocks but no tensors.
"""

from __future__ import annotations

import random

import pytest

from hetmesh.errors import InvalidRequest, Rejected
from hetmesh.node.kvcache import KVLimits, KVManager
from hetmesh.partition.blocks import BlockAllocator, blocks_for


class Pool:
    def __init__(self, num_blocks: int, block_tokens: int = 16) -> None:
        self.allocator = BlockAllocator(num_blocks, block_tokens)
        self.block_tokens = block_tokens
        self.block_bytes = 100
        self.cached_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.allocator.free_blocks


class Cache:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.freed = False

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_tokens

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes

    def reserve(self, tokens: int) -> bool:
        missing = blocks_for(tokens, self.pool.block_tokens) - len(self.blocks)
        if missing <= 0:
            return True
        got = self.pool.allocator.allocate(missing, after=self.blocks[-1] if self.blocks else None)
        if got is None:
            return False
        self.blocks += got
        return True

    def free(self) -> None:
        assert not self.freed, "freed twice"
        self.pool.allocator.free(self.blocks)
        self.blocks, self.freed = [], True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(blocks=10, max_sessions=4, max_tokens=160, idle=10.0, reserve=1, whole=False, fcfs=False):
    clock, pool = Clock(), Pool(blocks)
    limits = KVLimits(max_sessions, max_tokens, blocks * 100, idle, reserve, whole, fcfs=fcfs)
    manager = KVManager(limits, pool=pool, factory=lambda: Cache(pool), clock=clock)
    return manager, pool, clock


def test_kvcache_admits_by_the_prompt_blocks_not_the_worst_case():
    kv, pool, _ = make(blocks=10)
    kv.open("a", 160, prompt_tokens=20)  # 2 blocks now, may grow to 10
    kv.open("b", 160, prompt_tokens=33)  # 3 blocks
    assert pool.free_blocks == 5
    assert kv.statistics().bytes_reserved == 500
    with pytest.raises(Rejected, match="busy"):
        kv.open("c", 160, prompt_tokens=65)  # 5 blocks + 1 reserve > 5 free
    kv.open("c", 160, prompt_tokens=64)  # 4 + 1 reserve
    assert kv.statistics().rejected_busy == 1
    assert kv.close("a")
    assert pool.free_blocks == 3


def test_kvcache_old_policy_reserves_the_whole_session():
    kv, pool, _ = make(blocks=10, whole=True)
    kv.open("a", 80, prompt_tokens=5)
    assert pool.free_blocks == 5
    kv.open("b", 80, prompt_tokens=5)
    with pytest.raises(Rejected, match="busy"):
        kv.open("c", 16, prompt_tokens=5)


@pytest.mark.parametrize(("max_tokens", "prompt"), [(0, 0), (-3, 0), (161, 1), (10, 11), (5, -1)])
def test_kvcache_refuses_impossible_sessions(max_tokens, prompt):
    kv, pool, _ = make()
    with pytest.raises(InvalidRequest):
        kv.open("a", max_tokens, prompt)
    assert kv.statistics().sessions == 0
    assert pool.free_blocks == pool.num_blocks


def test_kvcache_refuses_a_session_larger_than_the_whole_pool():
    kv, _, _ = make(blocks=4, max_tokens=1000)
    with pytest.raises(InvalidRequest, match="whole KV pool of 64 tokens"):
        kv.open("a", 65, prompt_tokens=3)


def test_kvcache_grows_and_preempts_the_newest_session_first():
    kv, pool, _ = make(blocks=6, reserve=0)
    for sid in ("old", "mid", "new"):
        kv.open(sid, 96, prompt_tokens=32)  # 2 blocks each: pool full
    assert kv.grow("old", 32) == []  # within its blocks
    assert kv.grow("old", 33) == ["new"]  # the newest gives way
    assert "new" not in kv
    assert pool.free_blocks == 1
    assert kv.grow("mid", 40) == []  # takes the freed block
    assert kv.grow("mid", 49) == ["mid"]  # now the newest itself: it is preempted
    assert "mid" not in kv
    assert kv.statistics().preempted == 2
    assert kv.grow("old", 96) == []  # alone, it may use the whole pool


def test_kvcache_alone_and_still_short_is_an_invalid_request():
    kv, _, _ = make(blocks=4, max_tokens=64, reserve=0)
    kv.open("a", 64, prompt_tokens=16)
    with pytest.raises(InvalidRequest, match="whole KV pool"):
        kv.grow("a", 65)


def test_kvcache_unknown_and_duplicate_sessions():
    kv, _, _ = make()
    with pytest.raises(InvalidRequest, match="unknown session"):
        kv.get("nope")
    kv.open("a", 1)
    with pytest.raises(InvalidRequest, match="already open"):
        kv.open("a", 1)
    assert not kv.close("nope")


def test_kvcache_expires_only_idle_sessions():
    kv, pool, clock = make(idle=10.0)
    kv.open("old", 16, 16)
    clock.now = 6.0
    kv.open("new", 16, 16)
    clock.now = 12.0
    assert kv.expire_idle() == ["old"]
    assert "new" in kv
    assert "old" not in kv
    kv.get("new")  # touching keeps it alive
    clock.now = 21.0
    assert kv.expire_idle() == []
    assert kv.statistics().expired == 1
    assert pool.free_blocks == pool.num_blocks - 1


def test_kvcache_never_leaks_blocks_over_many_mixed_sessions():
    """Sessions open, grow, get preempted, expire and close in a random order: at the
    end the pool is whole again and every block was freed exactly once."""
    rng = random.Random(14)
    kv, pool, clock = make(blocks=40, max_sessions=8, max_tokens=200, idle=5.0)
    lengths: dict[str, int] = {}
    for n in range(400):
        clock.now += rng.random()
        action = rng.random()
        if action < 0.3:
            sid, prompt = f"s{n}", rng.randint(1, 150)
            try:
                kv.open(sid, rng.randint(prompt, 200), prompt)
                lengths[sid] = prompt
            except Rejected:
                pass
        elif action < 0.8 and lengths:
            sid = rng.choice(sorted(lengths))
            lengths[sid] = min(200, lengths[sid] + rng.randint(1, 20))
            kv.get(sid)
            for gone in kv.grow(sid, lengths[sid]):
                del lengths[gone]
        elif action < 0.95 and lengths:
            sid = rng.choice(sorted(lengths))
            assert kv.close(sid)
            del lengths[sid]
        else:
            for sid in kv.expire_idle():
                del lengths[sid]
        assert sorted(lengths) == sorted(s for s in lengths if s in kv)
        assert kv.statistics().sessions == len(lengths)
    assert kv.statistics().preempted > 0
    for sid in list(lengths):
        kv.close(sid)
    assert pool.free_blocks == pool.num_blocks
    assert kv.statistics().bytes_reserved == 0


@pytest.mark.parametrize(("blocks", "reserve"), [(6, 1), (64, 2), (512, 16)])
def test_kvcache_default_reserve_is_a_thirty_second_of_the_pool(blocks, reserve):
    clock, pool = Clock(), Pool(blocks)
    kv = KVManager(KVLimits(4, 16 * blocks, 0), pool=pool, factory=lambda: Cache(pool), clock=clock)
    assert kv.reserve_blocks == reserve
    with pytest.raises(Rejected, match="busy"):
        kv.open("big", 16 * blocks, prompt_tokens=16 * (blocks - reserve) + 1)
    kv.open("fits", 16 * blocks, prompt_tokens=16 * (blocks - reserve))
