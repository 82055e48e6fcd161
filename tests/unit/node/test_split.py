"""The pure parts of a split prefill (:mod:`hetmesh.node.split`)."""

from __future__ import annotations

import dataclasses

import pytest

from hetmesh.node.control import OpenSession, parse_request
from hetmesh.node.split import (
    Replica,
    choose_helper,
    is_helped_chunk,
    span_of,
    split_requests,
    split_role,
    split_unit,
)
from hetmesh.partition.sampling import SamplingParams

UNSPLIT = OpenSession(
    session_id="s",
    start=0,
    end=32,
    next_peer="gw",
    gateway="gw",
    previous_peer="gw",
    max_tokens=400,
    prompt_tokens=300,
    sampling=SamplingParams(),
    feed_steps=16,
    stop_ids=(2,),
)
MAIN = Replica(peer_id="a", start=0, end=32, weights="int4", busy=False)


def test_the_requests_give_each_side_its_part() -> None:
    main, helping = split_requests(UNSPLIT, "a", "b", split_unit(0, 32))
    assert split_unit(0, 32) == main.split == helping.split == 16
    assert (split_role(main), split_role(helping), split_role(UNSPLIT)) == ("main", "helper", "")
    assert main.helper == "b"
    assert main.next_peer == "gw"
    assert main.feed_steps == 16
    # the helper holds the prompt only, sends on to the route's stage, samples nothing
    assert helping.next_peer == "a"
    assert helping.max_tokens == 300
    assert helping.feed_steps == 1
    assert helping.stop_ids == ()
    assert helping.helper == ""
    for request in (main, helping):  # they travel as any control request
        assert parse_request(request.to_wire()) == request


def test_spans_cut_the_prompt_and_only_the_prompt() -> None:
    main, helping = split_requests(UNSPLIT, "a", "b", 16)
    assert span_of((0, 1, 2), helping) == (0, 16)
    assert span_of((200, 299), main) == (16, 32)
    assert is_helped_chunk((200, 299), main)
    assert span_of((300,), main) is None
    assert not is_helped_chunk((300,), main)
    assert span_of((0,), UNSPLIT) is None
    assert not is_helped_chunk((0,), UNSPLIT)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"split": 32}, "split must lie within"),  # not inside the units
        ({"split": 0, "helper": "b"}, "a helper helps"),  # a helper with no split
        ({"split": 16, "helper": ""}, "samples nothing"),  # the helper must not feed itself
    ],
)
def test_impossible_splits_are_refused(changes: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        dataclasses.replace(UNSPLIT, **changes)


def test_the_helper_is_an_idle_copy_of_the_same_units_and_format() -> None:
    same = Replica(peer_id="b", start=0, end=32, weights="int4", busy=False, row_cost=2.0)
    faster = dataclasses.replace(same, peer_id="c", row_cost=1.0)
    assert choose_helper(MAIN, [MAIN, same, faster], frozenset()) == (faster, 16)
    assert choose_helper(MAIN, [MAIN, same, faster], frozenset({"c"})) == (same, 16)
    for other in (
        dataclasses.replace(same, busy=True),
        dataclasses.replace(same, weights="native"),  # other hidden states and KV
        dataclasses.replace(same, end=16),
        dataclasses.replace(MAIN),  # itself
    ):
        assert choose_helper(MAIN, [MAIN, other], frozenset()) is None
    # a helper holding less of the prompt's prefix would make the stage recompute it
    cached = dataclasses.replace(MAIN, cached_tokens=64)
    assert choose_helper(cached, [same], frozenset()) is None
    assert choose_helper(cached, [dataclasses.replace(same, cached_tokens=64)], frozenset())
    unknown = dataclasses.replace(same, weights="")  # a format nobody announced: no match
    assert choose_helper(dataclasses.replace(MAIN, weights=""), [unknown], frozenset()) is None


def test_the_cut_follows_measured_speeds_beyond_noise() -> None:
    assert split_unit(0, 32) == split_unit(0, 32, 0.01, 0.012) == 16  # like speeds: halves
    assert split_unit(0, 32, 0.01, 0.0) == 16  # unmeasured: halves
    # a helper twice as slow takes a third of the 30 layers: both sides take as long
    assert split_unit(0, 32, 0.01, 0.02) == 1 + 10
    assert split_unit(0, 32, 0.02, 0.01) == 1 + 20
    assert 2 <= split_unit(0, 32, 1.0, 1e-6) <= 30  # each side keeps a layer
    assert 2 <= split_unit(0, 32, 1e-6, 1.0) <= 30
    main = dataclasses.replace(MAIN, block_step_s=0.01)
    slow = Replica(peer_id="b", start=0, end=32, weights="int4", busy=False, block_step_s=0.02)
    faster = dataclasses.replace(slow, peer_id="c", block_step_s=0.008)
    assert choose_helper(main, [slow], frozenset()) == (slow, 11)
    assert choose_helper(main, [slow, faster], frozenset()) == (faster, 16)
    too_slow = dataclasses.replace(slow, block_step_s=0.031)  # past SLOWEST_HELPER
    assert choose_helper(main, [too_slow], frozenset()) is None
