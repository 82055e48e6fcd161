"""A relay's bookkeeping: reservations expire and cap, circuits cap, bytes are paced."""

from __future__ import annotations

import pytest

from hetmesh.nat.relay_limits import RelayBook, RelayLimits, TokenBucket


def test_reservations_are_capped_renewable_and_expire() -> None:
    book = RelayBook(RelayLimits(max_reservations=2, reservation_ttl_s=10.0))
    assert book.reserve("a", now=0.0) is None
    assert book.reserve("b", now=1.0) is None
    reason = book.reserve("c", now=2.0)
    assert reason is not None
    assert "full" in reason
    assert book.reserve("a", now=5.0) is None  # a renewal is never refused
    assert book.reserve("c", now=11.5) is None  # b's slot ran out at 11.0
    assert set(book.reservations) == {"a", "c"}
    assert book.refused == 1


def test_circuits_need_a_reservation_and_are_capped() -> None:
    limits = RelayLimits(max_circuits=3, max_circuits_per_peer=2)
    book = RelayBook(limits)
    assert book.open("s", "d", now=0.0) == "the destination holds no reservation on this relay"
    book.reserve("d", now=0.0)
    book.reserve("e", now=0.0)
    assert book.open("d", "d", now=0.0) == "a circuit to oneself"
    assert book.open("s", "d", now=0.0) is None
    assert book.open("t", "d", now=0.0) is None
    per_peer = book.open("u", "d", now=0.0)  # d already carries two
    assert per_peer is not None
    assert "per member" in per_peer
    assert book.open("u", "e", now=0.0) is None
    busy = book.open("v", "e", now=0.0)
    assert busy is not None
    assert "busy" in busy
    book.close("s", "d")
    assert book.open("v", "d", now=0.0) is None
    assert book.open_circuits == 3
    assert book.circuits == {"d": 2, "t": 1, "u": 1, "e": 1, "v": 1}


def test_token_bucket_paces_to_the_rate_after_the_burst() -> None:
    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.take(500, now=0.0) == 0.0  # the burst goes at once
    assert bucket.take(250, now=0.0) == pytest.approx(0.25)
    assert bucket.take(250, now=1.0) == 0.0  # a second refilled 1000, capped at 500
    book = RelayBook(RelayLimits(bandwidth_bps=1e6, burst_bytes=1_000_000))
    waits = [book.charge("a", 250_000, now=0.0) for _ in range(8)]
    assert waits[:4] == [0.0] * 4
    assert waits[-1] == pytest.approx(1.0)  # 2 MB at 1 MB/s with 1 MB of credit
    assert book.charge("b", 250_000, now=0.0) == 0.0  # each member has its own bucket


@pytest.mark.parametrize(
    "bad",
    [
        {"max_reservations": 0},
        {"max_circuits": 0},
        {"max_circuits_per_peer": 0},
        {"reservation_ttl_s": 0.0},
        {"bandwidth_bps": -1.0},
    ],
)
def test_limits_reject_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RelayLimits"):
        RelayLimits(**bad)  # type: ignore[arg-type]
