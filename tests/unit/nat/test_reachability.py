"""Reachability's pure core: dial-back messages, what may be dialled, the verdict, status."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetmesh.cli.status import render_status
from hetmesh.errors import RemoteProtocolError
from hetmesh.nat.reachability import (
    BEHIND_NAT,
    EXTRA_KEY,
    MAX_DIALBACK_ADDRS,
    PUBLIC,
    RELAY_KEY,
    RELAYED_KEY,
    UNKNOWN,
    VIA_KEY,
    DialbackReply,
    DialbackRequest,
    advice,
    dialable,
    link_kind,
    reach_of,
    reach_text,
    tcp_endpoint,
    to_wire,
    verdict,
)

PEER = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaa1111"


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        (f"/ip4/10.0.0.2/tcp/4001/p2p/{PEER}", ("10.0.0.2", 4001)),
        ("/ip4/192.168.1.5/tcp/4001", ("192.168.1.5", 4001)),
        ("/ip6/::1/tcp/9", ("::1", 9)),
        ("/ip4/10.0.0.2/udp/4001/quic", None),
        ("/dns4/example.org/tcp/4001", None),
        ("/ip4/10.0.0.2/tcp/0", None),
        ("/ip4/10.0.0.2/tcp/70000", None),
        ("/ip4/10.0.0.2/tcp/x", None),
        ("ip4/10.0.0.2/tcp/1", None),
        ("", None),
    ],
)
def test_tcp_endpoint_reads_ip_tcp_multiaddrs_only(
    addr: str, expected: tuple[str, int] | None
) -> None:
    assert tcp_endpoint(addr) == expected


def test_dialable_keeps_only_addresses_at_the_observed_ip() -> None:
    addrs = [
        "/ip4/192.168.1.5/tcp/4001",  # a home's private address: not what the member sees
        "/ip4/203.0.113.7/tcp/4001",
        "/ip4/203.0.113.7/udp/4001/quic",
        "/ip4/198.51.100.1/tcp/4001",  # a third party: never dialled
    ]
    assert dialable(addrs, "203.0.113.7") == [("/ip4/203.0.113.7/tcp/4001", "203.0.113.7", 4001)]
    assert dialable(addrs, "10.9.9.9") == []  # behind NAT: the router's address is none
    assert dialable(addrs, None) == []
    many = [f"/ip4/203.0.113.7/tcp/{p}" for p in range(1, 40)]
    assert len(dialable(many, "203.0.113.7")) == MAX_DIALBACK_ADDRS


def _reply(reached: bool) -> DialbackReply:
    return DialbackReply(reached, "/ip4/203.0.113.7/tcp/4001" if reached else "", "203.0.113.7", 1)


@pytest.mark.parametrize(
    ("reached", "expected"),
    [
        ((), UNKNOWN),
        ((False,), BEHIND_NAT),
        ((False, False, False), BEHIND_NAT),
        ((False, True), PUBLIC),
        ((True,), PUBLIC),
    ],
)
def test_verdict_public_once_reached_behind_nat_once_answered(
    reached: tuple[bool, ...], expected: str
) -> None:
    assert verdict([_reply(r) for r in reached]) == expected


def test_messages_round_trip() -> None:
    request = DialbackRequest(("/ip4/1.2.3.4/tcp/5",), 4242)
    assert DialbackRequest.decode(request.encode()) == request
    reply = _reply(True)
    assert DialbackReply.decode(reply.encode()) == reply


@pytest.mark.parametrize(
    "raw",
    [
        [1, 2],
        {"addrs": "x", "probe_port": 1},
        {"addrs": ["/ip4/1.2.3.4/tcp/5"] * (MAX_DIALBACK_ADDRS + 1), "probe_port": 1},
        {"addrs": ["x" * 300], "probe_port": 1},
        {"addrs": [3], "probe_port": 1},
        {"addrs": [], "probe_port": 70000},
        {"addrs": [], "probe_port": True},
        {"addrs": []},
    ],
)
def test_request_decode_rejects_ill_formed(raw: object) -> None:
    with pytest.raises(RemoteProtocolError):
        DialbackRequest.decode(msgpack.packb(raw))


@given(st.binary(max_size=300))
def test_random_bytes_parse_or_raise_remote_protocol_error(blob: bytes) -> None:
    for decode in (DialbackRequest.decode, DialbackReply.decode):
        with contextlib.suppress(RemoteProtocolError):
            decode(blob)


def test_reach_of_reads_the_record_and_defaults_to_unknown() -> None:
    assert reach_of({"extra": {EXTRA_KEY: to_wire(PUBLIC)}}) == PUBLIC
    assert reach_of({"extra": {EXTRA_KEY: to_wire(BEHIND_NAT)}}) == BEHIND_NAT
    assert reach_of({"extra": {EXTRA_KEY: "sideways"}}) == UNKNOWN
    assert reach_of({"extra": {EXTRA_KEY: 7}}) == UNKNOWN
    assert reach_of({"extra": None}) == UNKNOWN
    assert reach_of({}) == UNKNOWN
    with pytest.raises(ValueError, match="unknown reachability"):
        to_wire("maybe")


def test_advice_only_behind_nat_without_a_public_member() -> None:
    line = advice(BEHIND_NAT, [BEHIND_NAT, UNKNOWN], 4001)
    assert line is not None
    assert "--bootstrap" in line
    assert "4001" in line
    assert advice(BEHIND_NAT, [BEHIND_NAT, PUBLIC], 4001) is None
    assert advice(PUBLIC, [BEHIND_NAT], 4001) is None
    assert advice(UNKNOWN, [], None) is None


def test_reach_text_says_why_a_peer_is_unreachable() -> None:
    relay = PEER
    assert reach_text({"extra": {EXTRA_KEY: "public", RELAY_KEY: 1}}) == "public, relays"
    assert reach_text({"extra": {EXTRA_KEY: "public", RELAY_KEY: 0}}) == "public"
    assert reach_text({"extra": {EXTRA_KEY: "nat", VIA_KEY: relay}}) == "behind NAT, via aaaa1111"
    assert "no relay" in reach_text({"extra": {EXTRA_KEY: "nat", VIA_KEY: ""}})
    assert reach_text({}) == "unknown"


def test_link_kind_is_relayed_when_either_end_says_so() -> None:
    a, b = "A", "B"
    assert link_kind(a, {"extra": {RELAYED_KEY: ["B"]}}, b, {}) == "relayed"
    assert link_kind(a, {}, b, {"extra": {RELAYED_KEY: ["A"]}}) == "relayed"
    assert link_kind(a, {"extra": {RELAYED_KEY: ["C"]}}, b, {"extra": {RELAYED_KEY: "A"}}) == (
        "direct"
    )


def test_status_shows_reachability_and_relayed_links() -> None:
    home = PEER[:-4] + "2222"

    def peer(pid: str, extra: dict[str, object]) -> dict[str, object]:
        record = {"addrs": [f"/ip4/10.0.0.2/tcp/4001/p2p/{pid}"], "extra": extra}
        return {"peer_id": pid, "health": "alive", "record": record}

    view = {
        "self": PEER,
        "peers": [
            peer(PEER, {EXTRA_KEY: "public", RELAY_KEY: 1}),
            peer(home, {EXTRA_KEY: "nat", VIA_KEY: PEER, RELAYED_KEY: [PEER]}),
        ],
        "links": [{"src": home, "dst": PEER, "rtt_s": 0.002, "bandwidth_bps": 1e7}],
    }
    text = render_status(view, width=250)
    assert "reach" in text
    assert "public, relays" in text
    assert "behind NAT, via aaaa1111" in text
    assert "(relayed)" in text
