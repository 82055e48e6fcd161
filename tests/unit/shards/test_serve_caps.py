"""The shard holder's request caps (pure bookkeeping)."""

from __future__ import annotations

import pytest

from hetmesh.errors import LocalProtocolError
from hetmesh.shards.serve_caps import ServeCaps, reply_deadline_s


def test_caps_per_peer_and_in_all() -> None:
    caps = ServeCaps(per_peer=2, total=3)
    assert caps.take("a")
    assert caps.take("a")
    assert not caps.take("a")  # per peer
    assert caps.take("b")
    assert not caps.take("c")  # in all
    caps.give_back("a")
    assert caps.take("c")
    assert (caps.in_flight, caps.refused) == (3, 2)
    with pytest.raises(LocalProtocolError):
        caps.give_back("z")


def test_a_reply_deadline_grows_with_its_size() -> None:
    assert reply_deadline_s(0) == 30.0
    assert reply_deadline_s(256 * 1024 * 60) == 90.0
