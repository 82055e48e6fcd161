"""``hetmesh status`` from a node's own view: every peer, the plan's links as measured
by their source, and estimates marked apart (no sockets: records fed to the service)."""

from __future__ import annotations

import trio

from hetmesh.cli.status import render_status
from hetmesh.discovery import wire
from hetmesh.discovery.service import Discovery, DiscoveryConfig
from hetmesh.discovery.wire import Announcement
from hetmesh.resources import LinkProfile

PEERS = ("PEER_B", "PEER_C", "PEER_D")


class _Host:
    def get_id(self) -> str:
        return "PEER_A"


def _record(peer: str, ip: str, links: tuple[LinkProfile, ...] = ()) -> Announcement:
    addr = f"/ip4/{ip}/tcp/4001/p2p/{peer}"
    return Announcement(version="0", peer_id=peer, boot_id=1, seq=1, addrs=(addr,), links=links)


def _cell(text: str, src: str, column: int) -> str:
    """The link matrix cell of row ``src``, ``column`` counted from the first peer."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells[:1] == [src] and len(cells) == 2 + len(PEERS):  # the matrix: A, B, C, D
            return cells[1 + column]
    raise AssertionError(f"no matrix row for {src}")


async def test_status_lists_every_peer_and_marks_estimated_links_apart() -> None:
    node = Discovery(_Host(), DiscoveryConfig(), psk="00" * 32)
    # the coordinator asked B for B -> C (the plan's link): B measured it
    b_to_c = LinkProfile(src="PEER_B", dst="PEER_C", rtt_s=2e-4, bandwidth_bps=3e9)
    records = {
        "PEER_B": _record("PEER_B", "10.0.0.1", (b_to_c,)),
        "PEER_C": _record("PEER_C", "10.0.0.1"),  # B's host: C -> B is estimated
        "PEER_D": _record("PEER_D", "192.168.9.9"),  # elsewhere: nothing to go by
    }
    now = trio.current_time()
    for peer, record in records.items():
        assert node.receive(wire.encode(record), peer, now=now) is not None

    view = node.view()
    assert {p["peer_id"] for p in view["peers"]} == {"PEER_A", *PEERS}
    text = render_status(view)
    lines = text.splitlines()
    for peer, health in (("PEER_A", "self"), *((p, "alive") for p in PEERS)):
        assert any(line.startswith(f"│ {peer} ") and f"│ {health} " in line for line in lines)
    # columns: A, B, C, D (the view lists itself first, then peers by id)
    assert _cell(text, "PEER_B", 2) == "0.20 ms, 3.0 GB/s"  # measured: no mark
    assert _cell(text, "PEER_C", 1) == "≈ 0.20 ms, 3.0 GB/s"  # estimated, marked
    assert _cell(text, "PEER_D", 1) == "?"
    assert _cell(text, "PEER_B", 3) == "?"
