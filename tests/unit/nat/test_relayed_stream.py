"""The data plane tells a relayed control connection from a direct one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.security.pnet.protector import new_protected_conn

from hetmesh.discovery.host import derive_psk
from hetmesh.transport.p2p import connection_is_relayed


def _stream_over(kind: ConnectionType, *, inbound: bool = False) -> SimpleNamespace:
    # the layers of a libp2p stream: yamux -> noise session -> noise framing -> pnet -> raw
    raw = RawConnection(None, initiator=True, connection_type=kind)  # type: ignore[arg-type]
    if inbound:  # the swarm wraps an accepted connection in a (direct) raw connection of its own
        raw = RawConnection(raw, initiator=False)
    protected = new_protected_conn(raw, derive_psk("s"))
    noise = SimpleNamespace(conn=protected)
    session = SimpleNamespace(conn=noise)
    return SimpleNamespace(muxed_conn=SimpleNamespace(secured_conn=session))


@pytest.mark.parametrize("inbound", [False, True])
@pytest.mark.parametrize(
    ("kind", "relayed"), [(ConnectionType.RELAYED, True), (ConnectionType.DIRECT, False)]
)
def test_connection_is_relayed_reads_the_raw_connection_type(
    kind: ConnectionType, relayed: bool, inbound: bool
) -> None:
    assert connection_is_relayed(_stream_over(kind, inbound=inbound)) is relayed


def test_connection_is_relayed_is_false_for_anything_else() -> None:
    loop = SimpleNamespace()
    loop.conn = loop  # a cycle ends the walk
    assert connection_is_relayed(loop) is False
    assert connection_is_relayed(None) is False
    assert connection_is_relayed(object()) is False
