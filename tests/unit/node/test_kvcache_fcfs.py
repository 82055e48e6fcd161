"""KVManager admits first come, first served: a refused session keeps its place (pure).

A large request refused for want of blocks (or of a session slot) must not be
overtaken by smaller ones arriving after it while its gateway retries; its
place lapses when the gateway stops retrying or after the admission wait, so
it cannot wedge the stage.
"""

from __future__ import annotations

import pytest

from hetmesh.errors import Rejected
from hetmesh.node.kvcache import MAX_WAITERS
from tests.unit.node.test_kvcache import make


def refused(kv, session_id, max_tokens, prompt_tokens) -> bool:
    try:
        kv.open(session_id, max_tokens, prompt_tokens=prompt_tokens)
    except Rejected:
        return True
    return False


@pytest.mark.parametrize("whole", [False, True], ids=["paged", "reserve-whole"])
def test_a_later_small_request_does_not_take_the_blocks_a_large_one_waits_for(whole):
    kv, pool, clock = make(blocks=10, max_tokens=160, whole=whole, fcfs=True)
    kv.open("a", 80, prompt_tokens=80)  # 5 blocks either way
    assert refused(kv, "large", 128, 128)  # 8 blocks: refused, keeps its place
    assert kv.waiting == 1
    clock.now += 0.5
    # 1 block would fit in the 5 free ones, but the large request came first
    assert refused(kv, "small", 16, 16)
    assert pool.free_blocks == 5
    kv.close("a")
    clock.now += 0.5
    kv.open("large", 128, prompt_tokens=128)  # its retry: admitted, out of the queue
    kv.open("small", 16, prompt_tokens=16)
    assert kv.waiting == 0


def test_a_waiter_keeps_a_session_slot_too():
    kv, _, _ = make(blocks=20, max_sessions=2, fcfs=True)
    kv.open("a", 32, prompt_tokens=16)
    kv.open("b", 32, prompt_tokens=16)
    assert refused(kv, "c", 32, 16)
    kv.close("a")
    assert refused(kv, "d", 32, 16)  # the free slot is c's
    kv.open("c", 32, prompt_tokens=16)


def test_waiters_are_served_in_arrival_order():
    kv, _, clock = make(blocks=10, max_sessions=8, fcfs=True)
    kv.open("a", 144, prompt_tokens=144)  # 9 blocks: nothing else fits
    assert refused(kv, "first", 96, 96)  # 6 blocks
    assert refused(kv, "second", 96, 96)
    kv.close("a")
    clock.now += 1
    assert refused(kv, "second", 96, 96)  # the pool could hold it, but first came first
    kv.open("first", 96, prompt_tokens=96)
    assert kv.waiting == 1


def test_a_waiter_whose_gateway_stopped_retrying_lapses():
    kv, _, clock = make(blocks=10, fcfs=True)
    kv.open("a", 80, prompt_tokens=80)
    assert refused(kv, "large", 128, 128)
    clock.now += 6.0  # not retried for longer than waiter_stale_s
    kv.open("small", 16, prompt_tokens=16)
    assert kv.waiting == 0


def test_a_waiter_cannot_wedge_the_stage_past_the_admission_wait():
    kv, _, clock = make(blocks=10, fcfs=True)
    kv.open("a", 80, prompt_tokens=80)
    for _ in range(31):  # retried every second: its place holds for 30 s
        assert refused(kv, "large", 128, 128)
        if clock.now < 30:
            assert refused(kv, "small", 16, 16)
        clock.now += 1.0
    kv.open("small", 16, prompt_tokens=16)


def test_a_request_no_empty_pool_could_admit_keeps_no_place():
    kv, _, _ = make(blocks=10, reserve=1, fcfs=True)
    kv.open("a", 16, prompt_tokens=16)
    # 10 blocks + 1 of reserve can never be free at once: it must not block others
    assert refused(kv, "never", 160, 160)
    assert kv.waiting == 0
    kv.open("small", 16, prompt_tokens=16)


def test_the_wait_queue_is_bounded():
    kv, _, _ = make(blocks=10, max_sessions=1, fcfs=True)
    kv.open("a", 16, prompt_tokens=16)
    for i in range(MAX_WAITERS + 5):
        assert refused(kv, f"w{i}", 16, 16)
    assert kv.waiting == MAX_WAITERS


def test_without_fcfs_a_later_request_may_overtake():
    from hetmesh.node.kvcache import KVLimits, KVManager
    from tests.unit.node.test_kvcache import Cache, Clock, Pool

    pool = Pool(10)
    limits = KVLimits(4, 160, 1000, 10.0, 1, fcfs=False)
    kv = KVManager(limits, pool=pool, factory=lambda: Cache(pool), clock=Clock())
    kv.open("a", 80, prompt_tokens=80)
    assert refused(kv, "large", 128, 128)
    kv.open("small", 16, prompt_tokens=16)
    assert kv.waiting == 0
