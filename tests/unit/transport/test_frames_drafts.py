"""A verify step's drafts on the wire: a plain step's header is what it always was,
drafts round-trip, and more than MAX_DRAFTS is refused on both ends."""

from __future__ import annotations

import msgpack
import pytest
import torch

from hetmesh.errors import LocalProtocolError, RemoteProtocolError
from hetmesh.speculative import accept
from hetmesh.transport.frames import (
    MAX_DRAFTS,
    PREFIX,
    Activations,
    decode_all,
    encode_bytes,
)


def _step(drafts: tuple[int, ...]) -> Activations:
    ids = torch.tensor([5, *drafts], dtype=torch.int64)
    return Activations(
        session_id="s",
        step=3,
        positions=tuple(range(10, 11 + len(drafts))),
        tensors=(ids,),
        drafts=drafts,
    )


def _header(data: bytes) -> list[object]:
    head_len = PREFIX.unpack_from(data)[3]
    header: list[object] = msgpack.unpackb(data[PREFIX.size : PREFIX.size + head_len])
    return header


def test_plain_step_header_leaves_drafts_out() -> None:
    data = encode_bytes(_step(()))
    assert len(_header(data)) == 4  # what a peer before issue 48 reads
    (frame,) = decode_all(data)
    assert isinstance(frame, Activations)
    assert frame.drafts == ()


def test_drafts_round_trip() -> None:
    data = encode_bytes(_step((7, 8, 9)))
    assert _header(data)[4] == [7, 8, 9]
    (frame,) = decode_all(data)
    assert isinstance(frame, Activations)
    assert frame.drafts == (7, 8, 9)
    assert frame.positions == (10, 11, 12, 13)
    assert torch.equal(frame.tensors[0], torch.tensor([5, 7, 8, 9]))


def test_too_many_drafts_refused_both_ways() -> None:
    too_many = tuple(range(MAX_DRAFTS + 1))
    with pytest.raises(LocalProtocolError):
        encode_bytes(_step(too_many))
    data = bytearray(encode_bytes(_step(tuple(range(MAX_DRAFTS)))))
    header = _header(bytes(data))
    header[4] = list(too_many)
    head = msgpack.packb(header, use_bin_type=True)
    magic, version, tag, _, payload = PREFIX.unpack_from(data)
    old_head = PREFIX.unpack_from(data)[3]
    body = bytes(data[PREFIX.size + old_head :])
    forged = PREFIX.pack(magic, version, tag, len(head), payload) + head + body
    with pytest.raises(RemoteProtocolError):
        decode_all(forged)
    header[4] = ["x"]  # not ints
    head = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        decode_all(PREFIX.pack(magic, version, tag, len(head), payload) + head + body)


def test_the_codec_and_the_acceptance_rule_agree_on_the_cap() -> None:
    assert accept.MAX_DRAFTS == MAX_DRAFTS
