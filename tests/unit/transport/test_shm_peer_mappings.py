"""What one peer's shm links map here is bounded over all its links together, and a
closed link gives its share back."""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import torch

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.frames import DEFAULT_LIMITS, Activations, encode_parts
from hetmesh.transport.shm import MIN_SEGMENT, PeerMappings, ShmLink, new_segment_fd


def test_a_peer_with_many_links_maps_no_more_than_its_share() -> None:
    mappings = PeerMappings(max_segments=3, max_bytes=64 * MIN_SEGMENT)
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    links = [ShmLink(right, "peer", DEFAULT_LIMITS, mappings=mappings) for _, right in pairs]
    other = ShmLink(pairs[2][1].dup(), "other", DEFAULT_LIMITS, mappings=mappings)
    t = torch.arange(4, dtype=torch.float32)
    head, _, _ = encode_parts(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
    fds = [new_segment_fd(i, MIN_SEGMENT) for i in range(8)]

    def map_on(link: ShmLink, seg_id: int, fd: int) -> None:
        packet = msgpack.packb([0, head, [seg_id], [[seg_id, MIN_SEGMENT]]])
        link.release(link._on_packet(packet, [fd]))

    try:
        map_on(links[0], 1, fds[0])
        map_on(links[0], 2, fds[1])
        map_on(links[1], 1, fds[2])  # each link alone is far below its own budget ...
        assert mappings.held("peer") == (3, 3 * MIN_SEGMENT)
        with pytest.raises(RemoteProtocolError, match="over all its links"):
            map_on(links[2], 1, fds[3])  # ... but the peer has its share
        assert links[2]._remote == {}
        map_on(other, 1, fds[4])  # another peer has its own
        links[0]._shutdown()  # a closed link gives its two back
        assert mappings.held("peer") == (1, MIN_SEGMENT)
        map_on(links[2], 1, fds[5])
        map_on(links[2], 2, fds[6])
        assert mappings.held("peer") == (3, 3 * MIN_SEGMENT)
    finally:
        for fd in fds:
            os.close(fd)
        for link in (*links[1:], other):
            link._shutdown()
        for left, _ in pairs:
            left.close()
    assert mappings.held("peer") == mappings.held("other") == (0, 0)
