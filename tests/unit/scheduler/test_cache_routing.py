"""Cache-aware routing: prefix summaries, the route memory, and route() with ``cached``."""

from __future__ import annotations

import pytest

from hetmesh.errors import NoRoute
from hetmesh.partition.prefix import PrefixCache, block_hashes
from hetmesh.scheduler import MeshLoad, PipelineLoad, Plan, RouteRequest, plan
from hetmesh.scheduler.announcement import (
    ServingAnnouncement,
    read_serving,
    serving_extra,
)
from hetmesh.scheduler.prefix_summary import (
    SUMMARY_BLOCKS,
    decode_summary,
    encode_summary,
    matched_blocks,
    truncate,
)
from hetmesh.scheduler.records import Pipeline, Stage
from hetmesh.scheduler.router import CachePolicy, RouteMemory, cached_blocks, route
from tests.unit.scheduler.sched_helpers import BARE, device, full_links, hand_stage, toy_model

PROMPT = list(range(100, 100 + 16 * 6))  # six full blocks
HASHES = block_hashes(PROMPT)


@pytest.fixture
def two_replicas() -> Plan:
    """Two equal single-device replicas, "a" first in plan order."""
    devs = [device(name, memory=1 << 34, flops=1e15, bandwidth=1e11) for name in ("a", "b")]
    out = plan(devs, full_links(devs), toy_model(8), objective="throughput", constraints=BARE)
    assert len(out.pipelines) == 2
    return out


def key_of(p: Plan, peer: str) -> str:
    return next(x.key for x in p.pipelines if peer in x.peers)


# -- summaries ---------------------------------------------------------------------


def test_summary_round_trips_truncated_hashes() -> None:
    text = encode_summary(HASHES)
    assert len(text) == 8 * len(HASHES)
    assert decode_summary(text) == {truncate(h) for h in HASHES}
    assert encode_summary(reversed(HASHES)) == text  # equal caches announce equal strings


def test_summary_is_bounded() -> None:
    many = block_hashes(list(range(16 * (SUMMARY_BLOCKS + 50))))
    assert len(decode_summary(encode_summary(many))) == SUMMARY_BLOCKS
    assert decode_summary(encode_summary(many, limit=3)) == {truncate(h) for h in many[:3]}


@pytest.mark.parametrize(
    "bad",
    [None, 7, b"00000001", "0000001", "zzzzzzzz", "0" * 8 * (SUMMARY_BLOCKS + 1), ["00000001"]],
)
def test_summary_ill_formed_reads_empty(bad: object) -> None:
    assert decode_summary(bad) == frozenset()


def test_matched_blocks_counts_the_leading_run_only() -> None:
    summary = decode_summary(encode_summary(HASHES[:3] + HASHES[4:]))  # block 3 missing
    assert matched_blocks(HASHES, summary) == 3
    assert matched_blocks(HASHES, frozenset()) == 0
    assert matched_blocks([], summary) == 0
    other = block_hashes([1, *PROMPT[1:]])  # differs in the first token: chain differs
    assert matched_blocks(other, summary) == 0


def test_prefix_cache_recent_hashes_held_first_then_idle_newest_first() -> None:
    cache = PrefixCache()
    for block, h in enumerate(HASHES[:4]):
        cache.insert(block, h)
    cache.release(0)  # idle, older
    cache.release(2)  # idle, newer
    assert cache.recent_hashes(10) == [HASHES[1], HASHES[3], HASHES[2], HASHES[0]]
    assert cache.recent_hashes(3) == [HASHES[1], HASHES[3], HASHES[2]]
    assert cache.recent_hashes(0) == []


def test_announcement_carries_prefix_summaries() -> None:
    text = encode_summary(HASHES[:2])
    state = ServingAnnouncement(model="m", prefix_summaries={(0, 4): text})
    back = read_serving(serving_extra(state))
    assert back.prefix_summaries == {(0, 4): text}
    assert back.prefix_summary(0, 4) == {truncate(h) for h in HASHES[:2]}
    assert back.prefix_summary(4, 8) == frozenset()
    assert read_serving(serving_extra(ServingAnnouncement())).prefix_summaries == {}


def test_announcement_drops_ill_formed_summary_entries() -> None:
    extra = serving_extra(ServingAnnouncement(model="m"))
    extra["prefix_summaries"] = [
        [0, 4, "00000001"],
        [4, 2, "00000002"],  # empty range
        [True, 4, "00000003"],
        [4, 8, 12],
        [8, 12, "0" * (8 * SUMMARY_BLOCKS + 8)],  # too long
        "junk",
    ]
    assert read_serving(extra).prefix_summaries == {(0, 4): "00000001"}
    extra["prefix_summaries"] = {"not": "a list"}
    assert read_serving(extra).model == "m"  # the rest of the record still counts


# -- the pure router -----------------------------------------------------------------


def stage(peer: str, start: int, end: int) -> Stage:
    return hand_stage(peer, start, end, device="cpu:0")


def pipeline(*stages: Stage) -> Pipeline:
    return Pipeline(
        stages=stages, decode_latency_s=0.1, prefill_s_per_1k=1, bottleneck_s=0.1, throughput_tps=1
    )


def test_cached_blocks_is_the_fewest_any_stage_holds() -> None:
    held = {"x": decode_summary(encode_summary(HASHES[:5]))}

    def summary(s: Stage) -> frozenset[int]:
        return held.get(s.peer_id, frozenset())

    one = pipeline(stage("x", 0, 4))
    two = pipeline(stage("x", 0, 2), stage("y", 2, 4))
    assert cached_blocks(one, HASHES, summary) == 5
    assert cached_blocks(two, HASHES, summary) == 0  # "y" holds none of it
    held["y"] = decode_summary(encode_summary(HASHES[:2]))
    assert cached_blocks(two, HASHES, summary) == 2
    assert cached_blocks(one, [], summary) == 0


def test_route_prefers_the_pipeline_holding_the_longest_prefix(two_replicas: Plan) -> None:
    a, b = key_of(two_replicas, "a"), key_of(two_replicas, "b")
    request = RouteRequest()
    assert route(two_replicas, MeshLoad(), request).peers == {"a"}  # no cache: plan order
    assert route(two_replicas, MeshLoad(), request, {b: 3}).peers == {"b"}
    assert route(two_replicas, MeshLoad(), request, {a: 2, b: 3}).peers == {"b"}
    assert route(two_replicas, MeshLoad(), request, {a: 3, b: 3}).peers == {"a"}  # tie: plan
    assert route(two_replicas, MeshLoad(), request, {a: 0, b: 0}).peers == {"a"}


def test_route_cache_loses_to_load_imbalance_past_both_thresholds(two_replicas: Plan) -> None:
    a, b = key_of(two_replicas, "a"), key_of(two_replicas, "b")
    request = RouteRequest()
    policy = CachePolicy(balance_abs=4, balance_rel=1.5)

    def busy(sessions_b: int, sessions_a: int = 0) -> MeshLoad:
        return MeshLoad(
            pipelines={
                a: PipelineLoad(active_sessions=sessions_a),
                b: PipelineLoad(active_sessions=sessions_b),
            }
        )

    assert route(two_replicas, busy(4), request, {b: 5}, policy).peers == {"b"}  # 4 - 0 ≤ 4
    assert route(two_replicas, busy(5), request, {b: 5}, policy).peers == {"a"}  # imbalanced
    # 15 vs 10: more than 4 apart but within 1.5×: the cache still wins
    assert route(two_replicas, busy(15, 10), request, {b: 5}, policy).peers == {"b"}
    assert route(two_replicas, busy(16, 10), request, {b: 5}, policy).peers == {"a"}


def test_route_short_cached_prefix_below_min_blocks_is_ignored(two_replicas: Plan) -> None:
    b = key_of(two_replicas, "b")
    policy = CachePolicy(min_blocks=4)
    assert route(two_replicas, MeshLoad(), RouteRequest(), {b: 3}, policy).peers == {"a"}
    assert route(two_replicas, MeshLoad(), RouteRequest(), {b: 4}, policy).peers == {"b"}


def test_route_cache_never_picks_an_unhealthy_pipeline(two_replicas: Plan) -> None:
    b = key_of(two_replicas, "b")
    sick = MeshLoad(unhealthy_peers=("b",))
    assert route(two_replicas, sick, RouteRequest(), {b: 6}).peers == {"a"}
    with pytest.raises(NoRoute):
        route(two_replicas, MeshLoad(unhealthy_peers=("a", "b")), RouteRequest(), {b: 6})


def test_route_session_affinity_beats_the_cache(two_replicas: Plan) -> None:
    a, b = key_of(two_replicas, "a"), key_of(two_replicas, "b")
    load = MeshLoad(sessions={"s": a})
    assert route(two_replicas, load, RouteRequest(session_id="s"), {b: 6}).peers == {"a"}


def test_route_memory_sends_a_conversation_back_where_it_went() -> None:
    memory = RouteMemory(capacity=8)
    turn_one = HASHES[:3]
    memory.remember(turn_one, "p1")
    turn_two = block_hashes([*PROMPT, *[7] * 40])  # the first turn, then more
    assert memory.matched(turn_two, "p1") == 3
    assert memory.matched(turn_two, "p2") == 0
    memory.remember(HASHES[:1], "p2")  # a shared first block sent elsewhere later
    assert memory.matched(turn_two, "p1") == 0
    assert memory.matched(turn_two, "p2") == 1
    memory.remember(block_hashes(list(range(5000, 5000 + 16 * 10))), "p3")
    assert len(memory) == 8  # bounded: the oldest are forgotten
    assert memory.matched(turn_two, "p2") == 0
