"""Counters off the wire are bounded, and a node's own never pass what it can send."""

from __future__ import annotations

import msgpack
import pytest

from hetmesh.discovery.membership import Kind, Membership, Message, Update
from hetmesh.discovery.membership_types import MAX_COUNTER, MAX_INCARNATION
from hetmesh.discovery.membership_wire import decode_message, encode_message
from hetmesh.discovery.table import Health
from hetmesh.discovery.wire import Announcement, decode_announcement, encode
from hetmesh.errors import RemoteProtocolError


def _gossip(*updates: Update, inc: int = 0, boot: int = 5) -> Message:
    return Message(Kind.GOSSIP, "C", "A", boot, inc, 1, updates=updates)


@pytest.mark.parametrize(
    "msg",
    [
        _gossip(Update("A", Health.SUSPECT, 1, MAX_INCARNATION + 1)),
        _gossip(Update("A", Health.SUSPECT, 1, 2**64 - 1)),
        _gossip(Update("B", Health.ALIVE, MAX_COUNTER + 1, 0)),
        _gossip(Update("B", Health.ALIVE, 1, 0, record_seq=2**64 - 1)),
        _gossip(inc=MAX_INCARNATION + 1),
        _gossip(boot=2**64 - 1),
    ],
)
def test_a_counter_past_its_bound_drops_the_message(msg: Message) -> None:
    with pytest.raises(RemoteProtocolError, match="over"):
        decode_message(encode_message(msg))


def test_counters_at_their_bounds_still_decode() -> None:
    msg = _gossip(Update("A", Health.SUSPECT, MAX_COUNTER, MAX_INCARNATION), inc=MAX_INCARNATION)
    assert decode_message(encode_message(msg)) == msg


def test_a_refutation_at_the_top_incarnation_stays_encodable() -> None:
    node = Membership("A", boot_id=1, addrs=("/x/A",))
    node.receive(
        Message(Kind.PING, "C", "A", 5, 0, 0, seq=1, src_addrs=("/x/C",)), 0.0
    )  # C is a member
    out = node.receive(_gossip(Update("A", Health.SUSPECT, 1, MAX_INCARNATION)), 1.0)
    assert node.incarnation == MAX_INCARNATION
    later = node.tick(2.0)
    assert later
    for msg in out + later:  # everything it sends still encodes
        assert decode_message(encode_message(msg)).src_incarnation <= MAX_INCARNATION
    assert {m.src_incarnation for m in later} == {MAX_INCARNATION}


def test_a_record_with_a_counter_past_its_bound_is_refused() -> None:
    record = Announcement(version="t", peer_id="B", boot_id=5, seq=1, addrs=())
    raw = msgpack.unpackb(encode(record), raw=False)
    for field, value in (("incarnation", MAX_INCARNATION + 1), ("seq", 2**64 - 1)):
        with pytest.raises(RemoteProtocolError, match="bound"):
            decode_announcement(msgpack.packb({**raw, field: value}))
