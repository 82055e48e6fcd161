"""How a long prefill is cut into chunks (pure: no trio, no model)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hetmesh.errors import InvalidRequest
from hetmesh.node.stage_server import QUEUED_PER_SESSION, _chunks_cap
from hetmesh.partition.prefill import (
    CHUNK_COST_LIMIT,
    MAX_PREFILL_CHUNKS,
    MAX_PREFILL_CHUNKS_ENV,
    PREFILL_CHUNK_ENV,
    PREFILL_CHUNK_TOKENS,
    PREFILL_TAPER_ENV,
    max_prefill_chunks,
    prefill_chunk_default,
    prefill_chunks,
    prefill_schedule,
    prefill_taper,
    route_chunk_tokens,
)


@pytest.mark.parametrize(
    ("count", "chunk", "sizes"),
    [
        (1, 128, [1]),  # a decode step
        (255, 128, [255]),  # shorter than two chunks: one frame
        (256, 128, [128, 128]),
        (512, 128, [128, 128, 128, 128]),
        (515, 128, [129, 129, 129, 128]),
        (4000, 128, [800, 800, 800, 800, 800]),  # never more frames than a stage queues
        (512, 96, [103, 103, 102, 102, 102]),  # the default floor: five
        (512, 0, [512]),  # chunking off
    ],
)
def test_prefill_chunks(count: int, chunk: int, sizes: list[int]) -> None:
    assert prefill_chunks(count, chunk, MAX_PREFILL_CHUNKS) == sizes


@given(
    count=st.integers(1, 100_000),
    chunk=st.integers(0, 4096),
    most=st.integers(1, 16),
)
def test_chunks_cover_the_feed_in_order_and_stay_within_bounds(
    count: int, chunk: int, most: int
) -> None:
    sizes = prefill_chunks(count, chunk, most)
    assert sum(sizes) == count
    assert 1 <= len(sizes) <= most
    if len(sizes) > 1:
        assert min(sizes) >= chunk
        assert max(sizes) - min(sizes) <= 1


def test_a_stage_queues_every_chunk_of_one_step() -> None:
    assert QUEUED_PER_SESSION >= MAX_PREFILL_CHUNKS


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_CHUNK_ENV, raising=False)
    assert prefill_chunk_default() == PREFILL_CHUNK_TOKENS
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "0")
    assert prefill_chunk_default() == 0
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "64")
    assert prefill_chunk_default() == 64
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "lots")
    with pytest.raises(InvalidRequest, match=PREFILL_CHUNK_ENV):
        prefill_chunk_default()


def test_the_chunk_cap_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HETMESH_PREFILL_MAX_CHUNKS`` caps a gateway's chunks (the default: 5), and the
    stages queue as many frames of one session (``_chunks_cap``)."""
    monkeypatch.delenv(MAX_PREFILL_CHUNKS_ENV, raising=False)
    assert max_prefill_chunks() == MAX_PREFILL_CHUNKS == _chunks_cap() == 5
    assert prefill_chunks(512, 64) == [103, 103, 102, 102, 102]
    monkeypatch.setenv(MAX_PREFILL_CHUNKS_ENV, "8")
    assert prefill_chunks(512, 64) == [64] * 8
    assert prefill_chunks(512, 128) == [128] * 4  # chunks of at least 128 still
    assert prefill_chunks(512, 64, 4) == [128] * 4  # a caller's own cap wins
    assert _chunks_cap() == 8
    monkeypatch.setenv(MAX_PREFILL_CHUNKS_ENV, "0")
    assert prefill_chunks(512, 64) == [512]
    monkeypatch.setenv(MAX_PREFILL_CHUNKS_ENV, "many")
    with pytest.raises(InvalidRequest, match=MAX_PREFILL_CHUNKS_ENV):
        prefill_chunks(512, 64)
    assert _chunks_cap() == MAX_PREFILL_CHUNKS  # a stage keeps serving


@pytest.mark.parametrize(
    ("costs", "tokens"),
    [
        ([], 128),  # nothing measured: chunks as before
        ([None, None], 128),
        ([1.0, 1.14, None], 128),  # compute-bound stages (fp32, int4 here)
        ([CHUNK_COST_LIMIT], 128),  # at the limit still pays
        ([1.0, 1.74], 0),  # one bandwidth-bound stage (bf16 with AMX) turns it off
        ([None, CHUNK_COST_LIMIT + 1e-9], 0),
    ],
)
def test_a_route_chunks_only_where_every_stage_measured_chunks_cheap(
    costs: list[float | None], tokens: int
) -> None:
    assert route_chunk_tokens(costs, 128) == tokens
    assert route_chunk_tokens(costs, 0) == 0  # off stays off
    assert route_chunk_tokens(iter(costs), 128) == tokens  # any iterable, read once


@pytest.mark.parametrize(
    ("count", "stages", "sizes"),
    [
        (512, 3, [85, 171, 171, 85]),  # the cut's TTFT@512: fill and drain halved
        (515, 2, [86, 172, 171, 86]),  # ends to the nearest token (85.8)
        (384, 3, [96, 192, 96]),
        (256, 3, [128, 128]),  # two chunks: both ends, even already
        (200, 3, [200]),  # one chunk: nothing to taper
        (512, 1, [128, 128, 128, 128]),  # one stage: nothing overlaps, even as before
        (1, 3, [1]),  # a decode step
    ],
)
def test_a_route_of_several_stages_tapers_its_chunks(
    count: int, stages: int, sizes: list[int]
) -> None:
    assert prefill_schedule(count, 128, 4, stages=stages, taper=True) == sizes


@pytest.mark.parametrize(
    ("count", "stages", "sizes"),
    [
        (512, 3, [64, 128, 128, 128, 64]),  # the cut's TTFT@512 (the quiet A/B's five)
        (512, 1, [103, 103, 102, 102, 102]),  # one stage: even
        (300, 3, [75, 150, 75]),  # three chunks of at least 96
        (191, 3, [191]),  # shorter than two chunks: whole
    ],
)
def test_the_default_schedule(count: int, stages: int, sizes: list[int]) -> None:
    assert (
        prefill_schedule(count, PREFILL_CHUNK_TOKENS, MAX_PREFILL_CHUNKS, stages=stages, taper=True)
        == sizes
    )


@given(
    count=st.integers(1, 100_000),
    chunk=st.integers(0, 4096),
    most=st.integers(1, 16),
    stages=st.integers(1, 8),
)
@example(count=3, chunk=1, most=3, stages=2)  # ends of half a token: one each
@example(count=5, chunk=1, most=5, stages=3)
@example(count=7, chunk=1, most=3, stages=2)  # floored ends were 1 / 5 / 1 (CI, 02:12)
def test_a_tapered_schedule_covers_the_feed_in_as_many_chunks(
    count: int, chunk: int, most: int, stages: int
) -> None:
    even = prefill_chunks(count, chunk, most)
    sizes = prefill_schedule(count, chunk, most, stages=stages, taper=True)
    assert sum(sizes) == count
    assert len(sizes) == len(even)  # never more frames than a stage queues
    assert min(sizes) >= 1
    if len(sizes) >= 3 and stages >= 2:
        middle = sizes[1:-1]
        assert max(middle) - min(middle) <= 1
        assert sizes[0] == sizes[-1]
        assert abs(2 * sizes[0] - min(middle)) <= 2  # the ends half a middle chunk
    else:
        assert sizes == even
    assert prefill_schedule(count, chunk, most, stages=stages, taper=False) == even


def test_the_taper_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_TAPER_ENV, raising=False)
    assert prefill_taper()
    assert prefill_schedule(512, 128, 4, stages=3) == [85, 171, 171, 85]
    monkeypatch.setenv(PREFILL_TAPER_ENV, "0")
    assert not prefill_taper()
    assert prefill_schedule(512, 128, 4, stages=3) == [128] * 4
