"""Node processes on loopback: bootstrap + peer exchange, status, liveness, secrets.

Liveness times come from the nodes' own logs (each health change is logged
with its time), measured from the moment the test signalled the victim: no
polling delay in them. The bounds are the product's targets plus
``SLACK_S`` for a loaded 2-core machine, where a node can wait a while for
the CPU before it notices anything.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from functools import partial

import pytest

from hetmesh.errors import AuthenticationFailed
from tests.integration.discovery.discovery_nodes import (
    SECRET,
    NodeFactory,
    NodeProc,
    fetch_view,
    health_changes,
    health_map,
    log_time,
    run_status,
    wait_for,
    wait_health,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240)]

LOOPBACK = ("--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0")
SLACK_S = 2.0  # on top of each liveness target: a loaded machine delays the nodes


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeFactory]:
    # each node runs its own CPU benchmark, as on a first start: the profiles below
    f = NodeFactory(tmp_path_factory.mktemp("mesh"), measure=True)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def cluster(factory: NodeFactory) -> list[NodeProc]:
    """Three nodes; the second and third know only the first's address."""
    first = factory.start(*LOOPBACK, name="a").wait_ready()
    rest = [factory.start(*LOOPBACK, "--bootstrap", first.addr, name=n) for n in ("b", "c")]
    return [first, *(n.wait_ready() for n in rest)]


def _all_alive(node: NodeProc, ids: set[str]) -> bool:
    health = health_map(fetch_view(node.addr))
    return all(health.get(i) == "alive" for i in ids - {node.peer_id})


def test_bootstrap_peer_exchange_and_status_lists_all_three(cluster: list[NodeProc]) -> None:
    ids = {n.peer_id for n in cluster}
    for node in cluster:  # b and c learn each other only through peer exchange
        wait_for(partial(_all_alive, node, ids), 60, f"{node.peer_id} to see all")

    def profiled() -> dict[str, object] | None:
        view = fetch_view(cluster[2].addr)
        records = {p["peer_id"]: p["record"] for p in view["peers"]}
        ok = set(records) >= ids and all(records[i]["devices"] for i in ids)
        return view if ok else None

    view = wait_for(profiled, 60, "profiles of all three")
    for peer in view["peers"]:
        cpu = peer["record"]["devices"][0]
        assert cpu["backend"] == "cpu"
        assert cpu["matmul_flops"] > 1e8
        assert cpu["memory_bandwidth_bps"] > 1e8
        assert 0 < cpu["memory_free_bytes"] <= cpu["memory_total_bytes"]

    done = run_status(["--mesh", cluster[1].addr, "--mesh-secret", SECRET])
    assert done.returncode == 0, done.stderr
    for node in cluster:
        assert node.peer_id[-8:] in done.stdout
    assert "FLOP/s" in done.stdout
    assert "alive" in done.stdout


def test_links_are_measured_between_all_pairs(cluster: list[NodeProc]) -> None:
    ids = {n.peer_id for n in cluster}

    def matrix() -> dict[tuple[str, str], dict[str, float]] | None:
        view = fetch_view(cluster[0].addr)
        links = {(lk["src"], lk["dst"]): lk for lk in view["links"]}
        want = {(s, d) for s in ids for d in ids if s != d}
        return links if want <= set(links) else None

    links = wait_for(matrix, 60, "a full link matrix", every_s=0.5)
    for link in links.values():
        assert link["rtt_s"] < 0.1
        assert link["bandwidth_bps"] > 20e6  # loopback
        assert link["measured_at_s"] > time.time() - 300


def _joined(observer: NodeProc, victim: NodeProc, since: float) -> None:
    wait_health(observer, victim.peer_id, {"alive"}, after=since, timeout_s=60)


def test_sigkill_marks_peer_dead_within_5s(cluster: list[NodeProc], factory: NodeFactory) -> None:
    observer = cluster[0]
    started = time.time()
    victim = factory.start(*LOOPBACK, "--bootstrap", observer.addr, name="killed").wait_ready()
    _joined(observer, victim, started)
    killed_at = time.time()
    victim.signal(signal.SIGKILL)
    dead_at = wait_health(observer, victim.peer_id, {"dead"}, after=killed_at, timeout_s=60)
    elapsed = dead_at - killed_at
    print(f"SIGKILL -> dead in {elapsed:.2f} s (observer's log)")
    assert elapsed <= 5.0 + SLACK_S, f"SIGKILL noticed after {elapsed:.2f} s"
    members = {p for p, h in health_map(fetch_view(observer.addr)).items() if h == "alive"}
    assert victim.peer_id not in members


def test_sigstop_dead_within_10s_then_readmitted_after_hysteresis_and_sigterm_leaves(
    cluster: list[NodeProc], factory: NodeFactory
) -> None:
    observer = cluster[0]
    started = time.time()
    victim = factory.start(*LOOPBACK, "--bootstrap", observer.addr, name="frozen").wait_ready()
    _joined(observer, victim, started)

    stopped_at = time.time()
    victim.signal(signal.SIGSTOP)
    dead_at = wait_health(observer, victim.peer_id, {"dead"}, after=stopped_at, timeout_s=60)
    elapsed = dead_at - stopped_at
    print(f"SIGSTOP -> dead in {elapsed:.2f} s (observer's log)")
    assert elapsed <= 10.0 + SLACK_S, f"SIGSTOP noticed after {elapsed:.2f} s"
    frozen = [new for _, new in health_changes(observer, victim.peer_id, after=stopped_at)]
    assert frozen[:2] == ["suspect", "dead"], frozen  # judged over a window: suspect first

    resumed_at = time.time()
    victim.signal(signal.SIGCONT)
    alive_at = wait_health(observer, victim.peer_id, {"alive"}, after=resumed_at, timeout_s=60)
    back = health_changes(observer, victim.peer_id, after=resumed_at)
    joining_at = next((t for t, new in back if new == "joining"), None)
    print(f"SIGCONT -> alive again in {alive_at - resumed_at:.2f} s; changes {back}")
    assert joining_at is not None, back  # on probation before re-admission
    # hysteresis (3 s) from its first announcement after the freeze, in the observer's time
    assert alive_at - joining_at >= 2.5, f"re-admitted {alive_at - joining_at:.2f} s after joining"

    victim.signal(signal.SIGTERM)
    assert victim.proc.wait(timeout=60) == 0
    # from the victim's own note that it got SIGTERM to the observer's record of its goodbye
    termed_at = log_time(victim, "received SIGTERM", after=alive_at)
    assert termed_at is not None, victim.log_tail()
    left_at = wait_health(observer, victim.peer_id, {"left"}, after=termed_at, timeout_s=30)
    print(f"SIGTERM -> left in {left_at - termed_at:.2f} s (victim's and observer's logs)")
    assert left_at - termed_at <= 2.0 + SLACK_S


STRANGER_SECRETS = {"wrong": "not-the-secret", "missing": None}


@pytest.fixture(scope="module")
def strangers(cluster: list[NodeProc], factory: NodeFactory) -> dict[str, NodeProc]:
    """A node with a wrong secret and one with none, both dialling the first node.

    Started together: each spends most of its life in the bootstrap's retries (about
    20 s of dial limits and pauses), so the two waits overlap. Neither needs its own
    CPU benchmark: its profile is never read.
    """
    return {
        key: factory.start(
            *LOOPBACK,
            "--bootstrap",
            cluster[0].addr,
            secret=secret,
            name=f"stranger-{secret or 'none'}",
            measure=False,
        )
        for key, secret in STRANGER_SECRETS.items()
    }


@pytest.mark.parametrize("key", list(STRANGER_SECRETS))
def test_wrong_or_missing_secret_fails_fast_and_never_joins(
    cluster: list[NodeProc], factory: NodeFactory, strangers: dict[str, NodeProc], key: str
) -> None:
    target = cluster[0]
    secret = STRANGER_SECRETS[key]
    stranger = strangers[key]
    try:
        code = stranger.proc.wait(timeout=240)  # start-up (imports) included: a deadline only
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node without the secret kept running:\n{stranger.log()}")
    log = stranger.log()
    assert code != 0
    assert "mesh secret" in log, log
    # from the join attempt to the refused dial, both from the node's own log
    attempt = log_time(stranger, "joining the mesh through")
    assert attempt is not None, log
    failure = log_time(stranger, f"bootstrap peer {target.addr}: ", after=attempt)
    assert failure is not None, log
    print(f"secret {secret!r}: failed {failure - attempt:.2f} s after the join attempt")
    assert failure - attempt <= 5.0 + SLACK_S, f"failed {failure - attempt:.2f} s after it"
    stranger_id = (stranger.data_dir / "identity.ed25519").exists()
    assert stranger_id
    view = fetch_view(target.addr)
    assert len(view["peers"]) == len({p["peer_id"] for p in view["peers"]})
    known = {p["peer_id"] for p in view["peers"]}
    assert known <= {n.peer_id for n in factory.nodes if n.info}


def test_status_with_wrong_secret_fails_fast_with_a_clear_message(cluster: list[NodeProc]) -> None:
    done = run_status(["--mesh", cluster[0].addr, "--mesh-secret", "nope"], timeout_s=90)
    assert done.returncode == 1
    assert "mesh secret" in done.stderr
    # the refusal itself, timed in this process (a CLI's start-up is mostly imports)
    began = time.monotonic()
    with pytest.raises(AuthenticationFailed, match="mesh secret"):
        fetch_view(cluster[0].addr, secret="nope", timeout_s=30)
    refused = time.monotonic() - began
    print(f"wrong secret refused in {refused:.2f} s")
    assert refused <= 3.0 + SLACK_S  # the handshake's 3 s limit, not a dial timeout


def test_malformed_announcements_never_crash_a_node(cluster: list[NodeProc]) -> None:
    import msgpack
    import trio
    from libp2p import generate_new_ed25519_identity
    from libp2p.custom_types import TProtocol

    from hetmesh.discovery import wire
    from hetmesh.discovery.host import derive_psk, dial, open_host, parse_peer_addr

    target = cluster[0]
    before = fetch_view(target.addr)["statistics"]["rejected"]
    good = wire.Announcement(version="0", peer_id="someone-else", boot_id=1, seq=1, addrs=())
    payloads = [
        b"\x00\x00\x00\x05hello",  # not msgpack
        wire.struct.pack(">I", 1 << 30),  # oversized length
        b"\x00\x00\x00\x03" + msgpack.packb([1, 2]),  # not a map
        _frame(msgpack.packb({"version": 1, "peer_id": 2})),  # mistyped, missing fields
        _frame(wire.encode(good)),  # impersonation: not the sender's peer id
        _frame(msgpack.packb({**good.to_wire(), "devices": [{"peer_id": 3}]})),
    ]

    async def attack() -> None:
        info = parse_peer_addr(target.addr)
        async with open_host(
            generate_new_ed25519_identity(), psk=derive_psk(SECRET), listen=["/ip4/127.0.0.1/tcp/0"]
        ) as host:
            await dial(host, info)
            for payload in payloads:
                stream = await host.new_stream(info.peer_id, [TProtocol(wire.ANNOUNCE_PROTOCOL)])
                await stream.write(payload)
                await stream.close()
                await trio.sleep(0.05)

    trio.run(attack)

    def counted() -> int | None:
        rejected = int(fetch_view(target.addr)["statistics"]["rejected"])
        return rejected if rejected - before >= len(payloads) else None

    rejected = wait_for(counted, 30, "every payload to be counted as rejected")
    assert rejected - before == len(payloads)  # each once
    assert target.proc.poll() is None
    health = health_map(fetch_view(target.addr))
    assert sum(h == "alive" for h in health.values()) >= 2


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload
