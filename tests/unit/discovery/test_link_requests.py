"""Links where they matter: requests carried in records, estimates marked apart."""

from __future__ import annotations

import trio

from hetmesh.cli.status import render_status
from hetmesh.discovery import wire
from hetmesh.discovery.service import Discovery, DiscoveryConfig, estimate_links
from hetmesh.discovery.wire import Announcement, LinkRequest


class _Host:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    def get_id(self) -> str:
        return self.peer_id


def _peer(peer_id: str, ip: str) -> dict[str, object]:
    return {
        "peer_id": peer_id,
        "health": "alive",
        "record": {"addrs": [f"/ip4/{ip}/tcp/4001/p2p/{peer_id}"]},
    }


def _link(src: str, dst: str, bandwidth_bps: float) -> dict[str, object]:
    return {"src": src, "dst": dst, "rtt_s": 1e-4, "bandwidth_bps": bandwidth_bps}


def test_estimate_links_fills_same_host_and_subnet_pairs_only() -> None:
    peers = [
        _peer("A", "10.0.0.1"),
        _peer("B", "10.0.0.1"),  # A's host
        _peer("C", "10.0.0.7"),  # A's subnet
        _peer("D", "10.0.0.8"),
        _peer("E", "192.168.1.1"),  # elsewhere
    ]
    measured = [_link("A", "B", 5e9), _link("A", "C", 1e8), _link("A", "C", 1e8)]
    got = {(e["src"], e["dst"]): e for e in estimate_links(peers, measured)}
    assert all(e["estimated"] is True for e in got.values())
    assert got[("B", "A")]["bandwidth_bps"] == 5e9  # same host as A -> B
    assert got[("C", "D")]["bandwidth_bps"] == 1e8  # same subnet as A -> C
    assert ("A", "B") not in got  # measured links are never estimated
    assert not any("E" in pair for pair in got)  # no basis for another site


def test_status_shows_estimated_links_apart_from_measured_ones() -> None:
    peers = [_peer("AAAAAAAAAA", "10.0.0.1"), _peer("BBBBBBBBBB", "10.0.0.1")]
    measured = [_link("AAAAAAAAAA", "BBBBBBBBBB", 5e9)]
    view = {
        "self": "AAAAAAAAAA",
        "peers": peers,
        "links": measured,
        "estimated_links": estimate_links(peers, measured),
    }
    text = render_status(view)
    rows = [line for line in text.splitlines() if "ms," in line]
    assert len(rows) == 2
    assert sum("≈" in row for row in rows) == 1  # B -> A estimated, A -> B measured
    assert "estimated" in text


async def test_discovery_publishes_link_requests_and_measures_those_asked_of_it() -> None:
    coordinator = Discovery(_Host("A"), DiscoveryConfig(), psk="00" * 32)
    coordinator.request_links([("A", "C"), ("B", "C"), ("B", "B")])
    record = coordinator.local_record()
    assert record.link_requests == (LinkRequest(src="B", dst="C"),)  # A measures its own
    assert coordinator._links_wanted == {"C"}

    b = Discovery(_Host("B"), DiscoveryConfig(), psk="00" * 32)
    now = trio.current_time()
    for peer in ("A", "C"):
        mine = (
            record
            if peer == "A"
            else Announcement(version="0", peer_id="C", boot_id=1, seq=1, addrs=())
        )
        assert b.receive(wire.encode(mine), peer, now=now) is not None
    b._read_link_requests()
    assert {e.peer_id for e in b.link_targets()} == {"A", "C"}
    assert "C" in b._links_wanted


def test_a_link_is_republished_only_when_its_figures_move() -> None:
    from hetmesh.discovery.service import _moved
    from hetmesh.resources import LinkProfile

    old = LinkProfile(src="A", dst="B", rtt_s=1e-4, bandwidth_bps=1e9)
    same = LinkProfile(src="A", dst="B", rtt_s=3e-4, bandwidth_bps=1.1e9)  # loopback jitter
    slower = LinkProfile(src="A", dst="B", rtt_s=1e-4, bandwidth_bps=0.5e9)
    farther = LinkProfile(src="A", dst="B", rtt_s=5e-3, bandwidth_bps=1e9)
    assert not _moved(old, same)
    assert _moved(old, slower)
    assert _moved(old, farther)
