"""The doorbell packets of a same-host (shm) link, and the checks on a peer's.

Pure: no descriptor, mapping or socket is touched here (:mod:`hetmesh.transport.shm`
does that once a packet has passed these checks).

- ``[_FRAME, head, seg_ids, new]``: a frame. ``head`` is the frame's normal head;
  each tensor's entry in ``seg_ids`` is the id of the sender's segment holding it,
  or, for a tensor of at most ``INLINE_BYTES`` (a decode step's activations), its
  bytes (at most ``INLINE_FRAME_BYTES`` a packet): no segment to copy into, and
  nothing to give back, so no release packet (which woke the sender's reader once a
  hop per token); ``new`` gives ``[segment id, size]`` of each descriptor passed with it.
- ``[_RELEASE, seg_ids]``: the receiver gives those segments back.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.frames import Limits, Pending, parse_head

MAX_PACKET = 1 << 20
INLINE_BYTES = 8 << 10
INLINE_FRAME_BYTES = 64 << 10
_FRAME, _RELEASE = 0, 1


class FramePacket(NamedTuple):
    """A doorbell packet carrying a frame, checked as far as it can be without the link."""

    pending: Pending  # the frame's head, checked by frames.parse_head
    seg_ids: list[object]  # each tensor's segment (the link checks it) or inline bytes
    new: list[list[int]]  # [segment id, size] of each passed descriptor


def parse_doorbell(data: bytes, fd_count: int, limits: Limits) -> FramePacket | list[object]:
    """Check one doorbell packet (pure: no descriptor is touched).

    ``[_FRAME, head, seg_ids, new]`` gives a :class:`FramePacket`: its frame
    head checked, one new descriptor per passed file with its size within
    ``limits.max_payload_bytes``, one segment id per tensor, or its bytes (of
    exactly the size its head describes, at most ``INLINE_BYTES``, at most
    ``INLINE_FRAME_BYTES`` in all).
    ``[_RELEASE, seg_ids]`` gives the released ids. The link then checks the
    ids against its segments (``ShmLink._on_packet``), still before mapping
    anything. :class:`RemoteProtocolError` on any fault.
    """
    try:
        message = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as exc:  # msgpack raises many types for garbage
        raise RemoteProtocolError(f"undecodable doorbell packet: {exc}") from None
    if not isinstance(message, list) or not message:
        raise RemoteProtocolError("malformed doorbell packet")
    if message[0] == _RELEASE and len(message) == 2 and isinstance(message[1], list):
        if fd_count:
            raise RemoteProtocolError("a release packet passed descriptors")
        return message[1]
    if message[0] != _FRAME or len(message) != 4:
        raise RemoteProtocolError("malformed doorbell packet")
    _, head, seg_ids, new = message
    if not isinstance(head, bytes) or not isinstance(seg_ids, list) or not isinstance(new, list):
        raise RemoteProtocolError("malformed doorbell packet")
    if len(new) != fd_count:
        raise RemoteProtocolError("segment descriptors do not match the passed fds")
    for item in new:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or type(item[0]) is not int
            or type(item[1]) is not int
            or not 0 < item[1] <= limits.max_payload_bytes
        ):
            raise RemoteProtocolError("bad shared-memory segment")
    pending = parse_head(head, limits)
    if len(seg_ids) != len(pending.specs):
        raise RemoteProtocolError("one segment per tensor expected")
    inline = 0
    for seg_id, spec in zip(seg_ids, pending.specs, strict=True):
        if type(seg_id) is bytes:
            inline += len(seg_id)
            if len(seg_id) != spec.nbytes or len(seg_id) > INLINE_BYTES:
                raise RemoteProtocolError("an inline tensor does not match its description")
    if inline > INLINE_FRAME_BYTES:
        raise RemoteProtocolError("too many inline tensor bytes in one doorbell packet")
    return tuple.__new__(FramePacket, (pending, seg_ids, new))  # NamedTuple's __new__ is slow
