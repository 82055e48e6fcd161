"""A control connection moved onto a hole-punched path: how it reads, whom we ask."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.security.pnet.protector import new_protected_conn

from hetmesh.discovery.host import derive_psk
from hetmesh.nat.punch_control import MAX_RETRY_S, MIN_RELAYED_AGE_S, ControlPuncher
from hetmesh.transport.p2p import PUNCHED_MARK, connection_is_relayed, control_path


def _stream_over(rwc: Any, kind: ConnectionType, *, inbound: bool) -> SimpleNamespace:
    # yamux -> noise session -> noise framing -> pnet -> raw -> the socket's byte stream
    raw = RawConnection(rwc, initiator=not inbound, connection_type=kind)
    protected = new_protected_conn(raw, derive_psk("s"))
    session = SimpleNamespace(conn=SimpleNamespace(conn=protected))
    return SimpleNamespace(muxed_conn=SimpleNamespace(secured_conn=session))


@pytest.mark.parametrize("inbound", [False, True])
def test_control_path_tells_punched_relayed_and_direct_apart(inbound: bool) -> None:
    punched = SimpleNamespace(**{PUNCHED_MARK: True})
    plain = SimpleNamespace()
    relayed = RawConnection(plain, initiator=True, connection_type=ConnectionType.RELAYED)
    direct = ConnectionType.DIRECT
    assert control_path(_stream_over(punched, direct, inbound=inbound)) == "hole-punched"
    assert control_path(_stream_over(plain, direct, inbound=inbound)) == "direct"
    assert control_path(_stream_over(relayed, direct, inbound=inbound)) == "relayed"
    # the data plane treats both NAT paths alike: the peer's endpoints are not dialable
    assert connection_is_relayed(_stream_over(punched, direct, inbound=inbound)) is True
    assert connection_is_relayed(_stream_over(plain, direct, inbound=inbound)) is False
    # only a mark set to True counts
    odd = SimpleNamespace(**{PUNCHED_MARK: "yes"})
    assert control_path(_stream_over(odd, direct, inbound=inbound)) == "direct"


def _puncher(me: str) -> ControlPuncher:
    network = SimpleNamespace(connections={})
    host = SimpleNamespace(get_network=lambda: network)
    return ControlPuncher(SimpleNamespace(peer_id=me, host=host))  # type: ignore[arg-type]


def test_only_the_lower_id_asks_and_only_after_the_relayed_connection_settled() -> None:
    puncher = _puncher("B")
    now = 1000.0
    relayed = {"A": now - 100, "C": now - 100, "D": now - 1}
    # "A" asks us (it is lower); "D" is too fresh (libp2p's trim would spare the relayed one)
    assert puncher.wanted(relayed, now) == ["C"]
    assert puncher.wanted(relayed, now + MIN_RELAYED_AGE_S) == ["C", "D"]


def test_a_failed_punch_backs_off_doubling_up_to_the_cap() -> None:
    import trio

    puncher = _puncher("A")
    waits = []

    async def fail_six_times() -> None:
        for _ in range(6):
            puncher._failed("B", "symmetric router")
            waits.append(puncher._retry_at["B"] - trio.current_time())

    trio.run(fail_six_times)
    assert waits == pytest.approx([30.0, 60.0, 120.0, 240.0, 480.0, MAX_RETRY_S], abs=1.0)
    assert puncher.failures == 6
    relayed = {"B": -1e9}
    assert puncher.wanted(relayed, puncher._retry_at["B"] - 1) == []
    assert puncher.wanted(relayed, puncher._retry_at["B"]) == ["B"]


def test_a_punched_connection_counts_while_the_swarm_holds_it() -> None:
    puncher = _puncher("A")
    conn = object()
    puncher.direct["B"] = conn
    network = puncher.discovery.host.get_network()
    network.connections["B"] = [conn]
    assert puncher.is_direct("B")
    assert puncher.wanted({"B": -1e9}, 0.0) == []
    network.connections["B"] = []  # closed: the relayed path is punched again later
    assert not puncher.is_direct("B")
    assert puncher.wanted({"B": -1e9}, 0.0) == ["B"]


def test_relay_statistics_count_punched_control_connections() -> None:
    from hetmesh.nat.relay import RelayClient

    puncher = _puncher("A")
    client = RelayClient(puncher.discovery, reachability=SimpleNamespace())  # type: ignore[arg-type]
    conn = object()
    client.control.direct["B"] = conn
    client.control.failures = 2
    network = client.discovery.host.get_network()
    network.connections["B"] = [conn]
    stats = client.statistics()
    assert (stats.control_punched, stats.control_punch_failures) == (1, 2)
    network.connections["B"] = []
    assert client.statistics().control_punched == 0
