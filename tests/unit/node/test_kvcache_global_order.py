"""First come, first served across the stages of a pipeline: one order, the gateway's stamp.

Two real KVManagers stand for the two stages of a pipeline; a gateway opens a
request on both at once and, refused anywhere, closes it everywhere and tries
again (as ``Gateway._open`` does). Two requests that each fit alone but not
together reach the stages in crossed order. Ordered by arrival, each heads
one stage's queue and is refused at the other, round after round; ordered by
the gateway's stamp, the older one gets both stages and the other follows.
"""

from __future__ import annotations

import math

import pytest

from hetmesh.errors import Rejected
from hetmesh.node.kvcache import MAX_WAITERS, STAMP_SLACK_S, KVLimits, KVManager, Stamp
from tests.unit.node.test_kvcache import Cache, Clock, Pool

ROUNDS = 20
BLOCKS_EACH = 6  # of 10 per stage: either request fits alone, not both


def stage(clock: Clock) -> KVManager[Cache]:
    pool = Pool(10)
    limits = KVLimits(4, 160, 1000, 300.0, reserve_blocks=1)
    return KVManager(limits, pool=pool, factory=lambda: Cache(pool), clock=clock, wall=clock)


def crossed_rounds(stamped: bool, *, younger_first_after: int | None = None) -> list[str]:
    """Run both requests until they finish (or ROUNDS pass); the order they got in.

    Both reach the stages in crossed order; from round ``younger_first_after`` on
    (None: never) the younger request reaches both stages first (it woke first
    from the same back-off, round after round).
    """
    clock = Clock()
    clock.now = 1000.0
    first, second = stage(clock), stage(clock)
    stamps = {"x": Stamp(1000.0, "x"), "y": Stamp(1000.5, "y")}
    done: list[str] = []
    for attempt in range(ROUNDS):
        held: dict[str, list[KVManager[Cache]]] = {"x": [], "y": []}
        refused: set[str] = set()
        orders = ((first, ("x", "y")), (second, ("y", "x")))
        if younger_first_after is not None and attempt >= younger_first_after:
            orders = ((first, ("y", "x")), (second, ("y", "x")))
        for kv, order in orders:
            for request in order:
                if request in done:
                    continue
                try:
                    kv.open(
                        f"{request}.{attempt}",  # a new session id each try, as the gateway's
                        16 * BLOCKS_EACH,
                        prompt_tokens=16 * BLOCKS_EACH - 16,
                        stamp=stamps[request] if stamped else None,
                    )
                    held[request].append(kv)
                except Rejected:
                    refused.add(request)
        for request, stages in held.items():
            whole = stages and request not in refused
            for kv in stages:
                if whole:
                    kv.get(f"{request}.{attempt}")  # it runs
                # refused somewhere: give all back (the gateway's close); or done
                kv.close(f"{request}.{attempt}", requeue=True)
            if whole:
                done.append(request)
        if len(done) == 2:
            break
        clock.now += 0.2  # the gateways' back-off
    return done


def test_requests_opened_at_once_on_two_stages_livelock_when_ordered_by_arrival():
    # the scenario the stamps are for: without them neither request ever gets both stages
    assert crossed_rounds(stamped=False) == []


def test_the_gateways_stamp_puts_the_same_request_first_on_every_stage():
    assert crossed_rounds(stamped=True) == ["x", "y"]


def test_a_request_given_back_unused_keeps_its_place_so_the_two_never_swap_stages():
    # crossed once, then the younger one first everywhere: admitted where the older
    # one held the stage a moment ago (and gave it back), it would take that stage
    # each round while the older one took the other; the older one keeps its place
    assert crossed_rounds(stamped=True, younger_first_after=1) == ["x", "y"]


def test_a_place_given_back_unused_goes_stale_when_its_request_never_returns():
    kv, clock = make()
    kv.open("old.0", 96, prompt_tokens=96, stamp=Stamp(999.0, "old"))  # 6 of 10 blocks
    kv.close("old.0", requeue=True)  # another stage refused it; its gateway gave up
    assert kv.waiting == 1
    assert refused(kv, "new.0", 6, Stamp(1000.0, "new"))  # it keeps the old one's room
    clock.now += 6.0  # past waiter_stale_s: the old request never came back
    assert not refused(kv, "new.0", 6, Stamp(1000.0, "new"))


def test_a_session_that_ran_or_was_not_stamped_keeps_no_place():
    kv, _ = make()
    kv.open("ran", 96, prompt_tokens=96, stamp=Stamp(999.0, "ran"))
    kv.get("ran")
    kv.close("ran", requeue=True)
    kv.open("plain", 96, prompt_tokens=96)
    kv.close("plain", requeue=True)
    kv.open("expired", 96, prompt_tokens=96, stamp=Stamp(999.5, "expired"))
    kv.close("expired")  # not its gateway's close (idle expiry, a move)
    assert kv.waiting == 0
    assert not refused(kv, "next", 9, Stamp(1000.0, "next"))


def make(blocks: int = 10, **limits: float) -> tuple[KVManager[Cache], Clock]:
    clock = Clock()
    clock.now = 1000.0
    pool = Pool(blocks)
    kv = KVManager(
        KVLimits(8, 160, 1000, 300.0, reserve_blocks=1, **limits),  # type: ignore[arg-type]
        pool=pool,
        factory=lambda: Cache(pool),
        clock=clock,
        wall=clock,
    )
    return kv, clock


def refused(kv: KVManager[Cache], session_id: str, blocks: int, stamp: Stamp | None) -> bool:
    try:
        kv.open(session_id, 16 * blocks, prompt_tokens=16 * blocks, stamp=stamp)
    except Rejected:
        return True
    return False


def test_an_older_stamp_goes_ahead_of_a_request_already_waiting():
    kv, clock = make()
    kv.open("a", 144, prompt_tokens=144)  # 9 blocks: nothing else fits
    assert refused(kv, "young.0", 6, Stamp(999.0, "young"))
    assert refused(kv, "old.0", 6, Stamp(990.0, "old"))
    kv.close("a")
    clock.now += 0.5
    assert refused(kv, "young.1", 6, Stamp(999.0, "young"))  # the old one is ahead
    kv.open("old.1", 96, prompt_tokens=96, stamp=Stamp(990.0, "old"))


def test_a_resumed_session_keeps_its_place_under_a_new_session_id():
    kv, clock = make()
    kv.open("a", 144, prompt_tokens=144)
    assert refused(kv, "early.3", 6, Stamp(900.0, "early"))  # preempted long ago, resuming
    assert refused(kv, "late.0", 6, Stamp(999.0, "late"))
    kv.close("a")
    clock.now += 0.5
    assert refused(kv, "late.1", 6, Stamp(999.0, "late"))
    # its next try: a new session id, the same stamp
    kv.open("early.4", 96, prompt_tokens=96, stamp=Stamp(900.0, "early"))
    assert kv.waiting == 1


def test_a_stamp_from_the_future_counts_as_now():
    kv, clock = make()
    kv.open("a", 144, prompt_tokens=144)
    # a skewed or forged clock far ahead: it does not wait behind everyone for ever
    assert refused(kv, "ahead.0", 6, Stamp(clock.now + 3600.0, "ahead"))
    clock.now += 0.1
    assert refused(kv, "later.0", 6, None)  # unstamped: first seen now, behind it
    kv.close("a")
    assert refused(kv, "later.1", 6, None)
    kv.open("ahead.1", 96, prompt_tokens=96, stamp=Stamp(clock.now + 3600.0, "ahead"))
    assert STAMP_SLACK_S < 3600.0


@pytest.mark.parametrize("at_s", [-math.inf, math.nan, 0.0])
def test_a_stamp_cannot_buy_a_place_older_than_the_bound(at_s):
    kv, clock = make(stamp_max_age_s=20.0)
    kv.open("a", 144, prompt_tokens=144)
    for attempt in range(13):  # an honest request, stamped 10 s ago, retried for 24 s
        assert refused(kv, f"honest.{attempt}", 6, Stamp(990.0, "honest"))
        clock.now += 2.0
    # claims to be older than anything: counts as at most 20 s old, behind the honest one
    assert refused(kv, "forged.0", 6, Stamp(at_s, "forged"))
    kv.close("a")
    assert refused(kv, "forged.1", 6, Stamp(at_s, "forged"))
    kv.open("honest.13", 96, prompt_tokens=96, stamp=Stamp(990.0, "honest"))


def test_a_place_held_past_the_admission_wait_queues_again_as_a_newcomer():
    kv, clock = make()
    kv.open("a", 144, prompt_tokens=144)
    for attempt in range(31):  # retried every second for longer than waiter_max_s (30 s)
        assert refused(kv, f"old.{attempt}", 6, Stamp(900.0, "old"))
        clock.now += 1.0
    assert refused(kv, "new.0", 6, Stamp(clock.now, "new"))  # old's place has lapsed
    assert refused(kv, "old.31", 6, Stamp(900.0, "old"))  # back in line, behind new
    kv.close("a")
    assert refused(kv, "old.32", 6, Stamp(900.0, "old"))
    kv.open("new.1", 96, prompt_tokens=96, stamp=Stamp(1000.0, "new"))


def test_a_full_queue_keeps_the_oldest_places():
    kv, clock = make(blocks=10)
    kv.open("a", 144, prompt_tokens=144)
    for i in range(MAX_WAITERS):
        assert refused(kv, f"w{i}.0", 1, Stamp(clock.now - 1.0 + i / 1000, f"w{i}"))
    assert refused(kv, "oldest.0", 1, Stamp(995.0, "oldest"))
    assert kv.waiting == MAX_WAITERS
    kv.close("a")
    # it kept a place, ahead of all the others
    kv.open("oldest.1", 16, prompt_tokens=16, stamp=Stamp(995.0, "oldest"))
