"""Hole punching for the data plane: candidates, the schedule, simultaneous open, the hook."""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import pytest
import torch
import trio
import trio.testing

from hetmesh.cli.status import render_status
from hetmesh.discovery.probe import TailClock, enable_timestamps, stream_bandwidth
from hetmesh.errors import RemoteProtocolError
from hetmesh.nat.link_probe import answer_punched, measure_punched
from hetmesh.nat.punch import local_host, reserve_port, simultaneous_open
from hetmesh.nat.punch_plan import (
    PUNCH_KEY,
    AttemptSchedule,
    Candidate,
    candidate_of,
    parse_candidate,
    punch_pair,
)
from hetmesh.nat.reachability import PUNCHED_KEY, RELAYED_KEY, link_kind
from hetmesh.nat.state import NatState
from hetmesh.transport import Activations, DataPlaneConfig, open_data_plane
from hetmesh.transport import dataplane as dataplane_module
from hetmesh.transport.links import TcpLink
from tests.unit.discovery.pacing import NBYTES, backlog_listener, paced_sender


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("10.200.1.11:40000", Candidate("10.200.1.11", 40000)),
        ("203.0.113.5:1", Candidate("203.0.113.5", 1)),
        ("10.200.1.11:0", None),
        ("10.200.1.11:65536", None),
        ("10.200.1.11", None),
        ("10.200.1.11:-3", None),
        ("127.0.0.1:4000", None),  # a peer never points our punch at our own loopback
        ("0.0.0.0:4000", None),
        ("224.0.0.1:4000", None),
        ("example.org:4000", None),
        ("[::1]:4000", None),
        ("1.2.3.4:" + "9" * 80, None),
        ("", None),
    ],
)
def test_parse_candidate_accepts_only_a_public_ipv4_endpoint(
    text: str, want: Candidate | None
) -> None:
    assert parse_candidate(text) == want


A = (("tcp", "10.150.0.2:5000"), (PUNCH_KEY, "10.200.1.10:41000"))
B = (("tcp", "10.150.1.2:6000"), (PUNCH_KEY, "10.200.1.11:42000"))
NO_CANDIDATE = (("tcp", "10.150.1.2:6000"),)


@pytest.mark.parametrize(
    ("relayed", "backend", "mine", "theirs", "want"),
    [
        (
            True,
            "tcp",
            A,
            B,
            (Candidate("10.200.1.10", 41000), Candidate("10.200.1.11", 42000)),
        ),
        (False, "tcp", A, B, None),  # a direct control connection needs no punch
        (True, "libp2p", A, B, None),
        (True, "shm", A, B, None),
        (True, "tcp", A, NO_CANDIDATE, None),  # the peer knows no public mapping
        (True, "tcp", NO_CANDIDATE, B, None),
        (True, "tcp", A, A, None),  # our own candidate echoed back
        (True, "tcp", A, ((PUNCH_KEY, "junk"),), None),
    ],
)
def test_punch_pair_needs_a_relayed_tcp_link_and_two_candidates(
    relayed: bool,
    backend: str,
    mine: tuple[tuple[str, str], ...],
    theirs: tuple[tuple[str, str], ...],
    want: tuple[Candidate, Candidate] | None,
) -> None:
    assert punch_pair(relayed, backend, mine, theirs) == want
    # both ends decide on the same two offers: the same verdict, mirrored
    mirrored = punch_pair(relayed, backend, theirs, mine)
    assert mirrored == (None if want is None else (want[1], want[0]))


def test_candidate_of_reads_the_punch_endpoint_only() -> None:
    assert candidate_of(A) == Candidate("10.200.1.10", 41000)
    assert candidate_of(NO_CANDIDATE) is None


def test_attempt_schedule_spaces_attempts_by_the_timeout() -> None:
    schedule = AttemptSchedule(attempts=3, timeout_s=3.5)
    assert schedule.starts() == (0.0, 3.5, 7.0)
    assert schedule.total_s == 10.5
    with pytest.raises(ValueError, match="attempt"):
        AttemptSchedule(attempts=0)
    with pytest.raises(ValueError, match="timeout"):
        AttemptSchedule(timeout_s=0)


def test_simultaneous_open_gives_up_after_the_schedule() -> None:
    reserved = reserve_port("127.0.0.1")
    nobody = reserve_port("127.0.0.1")  # bound, never listening or connecting: refuses
    try:
        local = ("127.0.0.1", reserved.getsockname()[1])
        remote = Candidate("127.0.0.1", nobody.getsockname()[1])
        assert simultaneous_open(local, remote, AttemptSchedule(attempts=2, timeout_s=0.2)) is None
    finally:
        reserved.close()
        nobody.close()


def _loose_candidate(endpoints: Any) -> Candidate | None:
    # loopback stands in for two routers' public addresses here
    text = dict(endpoints).get(PUNCH_KEY)
    if not text:
        return None
    ip, _, port = text.rpartition(":")
    return Candidate(ip, int(port))


def _loose_pair(
    relayed: bool, backend: str, mine: tuple[tuple[str, str], ...], theirs: Any
) -> tuple[Candidate, Candidate] | None:
    ours, other = _loose_candidate(mine), _loose_candidate(theirs)
    return (ours, other) if relayed and backend == "tcp" and ours and other else None


def _loopback_open(
    local: tuple[str, int], remote: Candidate, schedule: AttemptSchedule
) -> socket.socket | None:
    """Stands in for two NAT routers on loopback, where a SYN to a port not yet
    connecting is refused at once instead of dropped: the lower port listens on its
    reserved port and the other connects to it (the real simultaneous open through
    routers: tests/integration/nat/test_punch_testbed.py)."""

    def bound() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(local)
        sock.settimeout(schedule.total_s)
        return sock

    if local[1] < remote.port:
        with bound() as server:
            server.listen(1)
            conn, _ = server.accept()
        conn.settimeout(None)
        return conn
    for _ in range(schedule.attempts):
        sock = bound()  # a socket whose connect failed cannot connect again
        try:
            sock.connect((remote.ip, remote.port))
        except ConnectionRefusedError:
            sock.close()
            time.sleep(schedule.timeout_s)
            continue
        sock.settimeout(None)
        return sock
    return None


@pytest.mark.parametrize("punchable", [True, False])
async def test_a_relayed_link_is_hole_punched_sealed_tcp_or_stays_on_the_stream(
    monkeypatch: pytest.MonkeyPatch, punchable: bool
) -> None:
    """Over a relayed control stream, both planes punch from their reserved ports, the
    dialer proves the one-time credential on the punched socket and both seal it; where
    no candidate is known the link rides the control stream, as before."""
    monkeypatch.setattr(dataplane_module, "control_path", lambda _stream: "relayed")
    monkeypatch.setattr(dataplane_module, "punchable_host", lambda _host: True)
    monkeypatch.setattr(dataplane_module, "punch_pair", _loose_pair)
    monkeypatch.setattr(dataplane_module, "candidate_of", _loose_candidate)
    monkeypatch.setattr(dataplane_module, "simultaneous_open", _loopback_open)
    schedule = AttemptSchedule(attempts=20, timeout_s=0.5)
    common: dict[str, Any] = {
        # torchdist (gloo) would win a direct link: a punched one is plain tcp
        "backends": ("torchdist", "tcp", "libp2p"),
        "gloo": True,
        "tcp_encryption": "always",
        "punch_schedule": schedule,
    }
    # the public IP each node's dial-back would have learned (none: nothing to punch from)
    nat = {"nat": NatState(public_ip="127.0.0.1" if punchable else None)}
    async with (
        open_data_plane(DataPlaneConfig(peer_id="A", **common, **nat)) as a,
        open_data_plane(DataPlaneConfig(peer_id="B", **common, **nat)) as b,
    ):
        left, right = trio.testing.memory_stream_pair()
        links: dict[str, Any] = {}

        async def accept() -> None:
            links["b"] = await b.accept(right, expected_peer_id="A")

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept)
                links["a"] = await a.connect(left, expected_peer_id="B")
        link_a, link_b = links["a"], links["b"]
        try:
            if punchable:
                assert isinstance(link_a, TcpLink)
                assert isinstance(link_b, TcpLink)
                assert "hole-punched" in link_a.reason
                assert "sealed" in link_a.reason
                assert "hole-punched" in link_b.reason
            else:
                assert link_a.backend.value == "libp2p"
                assert "hole-punched" not in link_a.reason
                assert "relayed" in link_a.reason
            x = torch.arange(1024, dtype=torch.float32)
            with trio.fail_after(30):
                await link_a.send(Activations(session_id="s", step=0, positions=(0,), tensors=(x,)))
                frame = await link_b.receive()
            assert isinstance(frame, Activations)
            assert torch.equal(frame.tensors[0], x)
        finally:
            await link_a.aclose()
            await link_b.aclose()


def test_link_kind_is_hole_punched_when_either_end_holds_a_punched_link() -> None:
    relayed_both = {RELAYED_KEY: ["B"]}
    assert link_kind("A", {"extra": {**relayed_both, PUNCHED_KEY: ["B"]}}, "B", {}) == (
        "hole-punched"
    )
    assert link_kind("A", {}, "B", {"extra": {PUNCHED_KEY: ["A"]}}) == "hole-punched"
    # punched towards someone else: this pair's connection is still relayed
    assert link_kind("A", {"extra": {**relayed_both, PUNCHED_KEY: ["C"]}}, "B", {}) == "relayed"
    assert link_kind("A", {"extra": {PUNCHED_KEY: "B"}}, "B", {}) == "direct"


def test_status_marks_a_hole_punched_link() -> None:
    home0, home1 = "12D3KooWhome0000", "12D3KooWhome1111"

    def peer(pid: str, extra: dict[str, object]) -> dict[str, object]:
        record = {"addrs": [f"/ip4/10.0.0.2/tcp/4001/p2p/{pid}"], "extra": extra}
        return {"peer_id": pid, "health": "alive", "record": record}

    view = {
        "self": home0,
        "peers": [
            peer(home0, {RELAYED_KEY: [home1], PUNCHED_KEY: [home1]}),
            peer(home1, {RELAYED_KEY: [home0], PUNCHED_KEY: [home0]}),
        ],
        "links": [{"src": home0, "dst": home1, "rtt_s": 0.002, "bandwidth_bps": 1e7}],
    }
    text = render_status(view, width=250)
    assert "(hole-punched)" in text
    assert text.count("(relayed)") == 1  # the caption's legend only, not the link


def test_punched_peers_forgets_closed_links() -> None:
    state = {"open": True}
    nat = NatState()
    nat.note_punched("P1", lambda: state["open"])
    assert "P1" in nat.punched_peers()
    state["open"] = False
    assert "P1" not in nat.punched_peers()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=30)
        accepted, _ = server.accept()
    return client, accepted


def test_punch_probe_measures_over_a_socket_and_demands_the_token() -> None:
    """The probe's two sides on a connected socket pair (what a punch hands them)."""
    token = b"t" * 16
    asker, answerer = _tcp_pair()
    done: dict[str, BaseException | None] = {}

    def answer() -> None:
        try:
            trio.run(answer_punched, answerer, token)
            done["error"] = None
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=answer)
    thread.start()
    measured = trio.run(measure_punched, asker, token, 1 << 20)
    thread.join(30)
    assert done == {"error": None}
    assert measured.rtt_s > 0
    assert measured.bandwidth_bps > 0
    # a connection that does not open with the token is dropped before any measurement
    stranger, answerer = _tcp_pair()
    stranger.sendall(b"x" * 16)
    with pytest.raises(RemoteProtocolError, match="token"):
        trio.run(answer_punched, answerer, token)
    stranger.close()


@pytest.mark.slow
def test_a_starved_punch_answerer_still_measures_the_link_rate() -> None:
    """The answering thread gets no CPU for the first 0.3 s of a paced transfer while
    the kernel buffers it, then drains the backlog at once: its kernel arrival times
    still see the sender's pace (a clock in user space saw about twice it)."""
    token = b"t" * 16
    listener = backlog_listener()
    out: dict[str, float] = {}
    prefix = token + b"B" + struct.pack(">Q", NBYTES)
    sender = threading.Thread(target=paced_sender, args=(listener.getsockname()[1], out, prefix))
    sender.start()
    try:
        conn, _ = listener.accept()
        assert enable_timestamps(conn)
        time.sleep(0.3)  # starved: the backlog builds up in the kernel
        trio.run(answer_punched, conn, token)
        sender.join(60)
    finally:
        listener.close()
    bandwidth = (NBYTES - NBYTES // 4) / out["tail_s"]
    sent = out["sent_bps"]
    assert 0.75 * sent < bandwidth < 1.25 * sent, (bandwidth, sent)


def test_a_stream_probe_never_reports_more_than_the_asker_saw_cross() -> None:
    """Over a libp2p stream the receiver's clock is in user space: a late receiver's
    tail (3 MiB in 0.1 s) is bounded by the asker's whole transfer (4 MiB in 0.32 s)."""
    nbytes = 4 << 20
    assert stream_bandwidth(nbytes, 0.1, 0.32) == pytest.approx(nbytes / 0.32)
    # a timely receiver's tail keeps slow start out: it wins when it is the lower
    assert stream_bandwidth(nbytes, 0.3, 0.35) == pytest.approx((nbytes - nbytes // 4) / 0.3)
    assert stream_bandwidth(100, 0.0, 0.01) == pytest.approx(100 / 0.01)  # no tail timed


def test_tail_clock_takes_the_kernel_arrivals_over_a_late_read() -> None:
    clock = TailClock(400)
    clock.read(100, 10.0)  # the first quarter, arrived at 10.0 s
    clock.read(300, 10.3)  # the rest, read late and at once: arrived by 10.3 s
    assert clock.remaining == 0
    assert clock.seconds() == pytest.approx(0.3)
    scaled = TailClock(400)
    scaled.read(150, 10.0)  # the read that crossed the quarter held 250 bytes still to come
    scaled.read(250, 10.25)
    assert scaled.seconds() == pytest.approx(0.25 * 300 / 250)


def test_punch_probe_binds_to_the_first_routable_announced_address() -> None:
    addrs = ["/ip4/127.0.0.1/tcp/4001", "/ip4/0.0.0.0/tcp/4001", "/ip4/10.150.0.2/tcp/4001"]
    assert local_host(addrs) == "10.150.0.2"
    assert local_host(["/ip4/127.0.0.1/tcp/4001", "/dns4/x/tcp/1"]) is None
