"""A hostile member's rumors against real daemons (real libp2p hosts, one trio run).

The attacker is a third daemon of the mesh (it holds the secret), which writes
membership messages of its own making on the membership protocol, as a member
running altered code could.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from hetmesh.discovery import wire
from hetmesh.discovery.membership_types import Kind, Message, Update
from hetmesh.discovery.membership_wire import MEMBERSHIP_PROTOCOL, encode_message
from hetmesh.discovery.table import Health
from hetmesh.node.daemon import Node, run_node
from tests.integration.discovery.discovery_nodes import in_process_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def _until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the daemons' own tasks change it
            await trio.sleep(0.05)


@asynccontextmanager
async def _three(tmp_path: Path) -> AsyncIterator[tuple[Node, Node, Node]]:
    """A, B and the attacker C, each alive in the others' tables."""
    async with trio.open_nursery() as nursery:
        a: Node = await nursery.start(run_node, in_process_config(tmp_path, "a"))
        b: Node = await nursery.start(
            run_node, in_process_config(tmp_path, "b", a.discovery.addrs[0])
        )
        c: Node = await nursery.start(
            run_node, in_process_config(tmp_path, "c", a.discovery.addrs[0])
        )
        nodes = (a, b, c)

        def converged() -> bool:
            return all(
                n.discovery.table.health_of(m.peer_id) is Health.ALIVE
                for n in nodes
                for m in nodes
                if m is not n
            )

        await _until(converged, 60, "three members alive everywhere")
        yield a, b, c
        for node in nodes:
            node.request_stop()


def _processed(node: Node) -> list[bytes]:
    """Membership payloads ``node`` has applied, in order (its own handler, observed)."""
    seen: list[bytes] = []
    service = node.discovery
    apply = service.receive_message

    def observed(payload: bytes, remote: str, now: float | None = None) -> None:
        apply(payload, remote, now)
        seen.append(payload)

    service.receive_message = observed  # type: ignore[method-assign]
    return seen


async def _send(attacker: Node, target: Node, *updates: Update) -> bytes:
    """One GOSSIP from ``attacker`` to ``target`` carrying ``updates``; the bytes sent."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    me = attacker.discovery.table
    msg = Message(
        Kind.GOSSIP,
        attacker.peer_id,
        target.peer_id,
        me.boot_id,
        me.incarnation,
        me.record_seq,
        updates=updates,
    )
    payload = encode_message(msg)
    host = attacker.discovery.host
    stream = await host.new_stream(ID.from_base58(target.peer_id), [TProtocol(MEMBERSHIP_PROTOCOL)])
    await wire.write_frame(stream, payload)
    await stream.close()
    return payload


async def test_a_suspicion_at_the_top_incarnation_neither_crashes_nor_silences_a_node(
    tmp_path: Path,
) -> None:
    """C tells A that A is suspect at incarnation 2**64-1. Before the fix A refuted at
    2**64, could encode none of its messages after, and the error ended its membership
    clock (the node process exited). Now the message is dropped as malformed, and A
    stays up and keeps gossiping: B hears from A after it."""
    async with _three(tmp_path) as (a, b, c):
        seen = _processed(a)
        table = a.discovery.table
        rejected = table.stats.rejected
        lie = Update(a.peer_id, Health.SUSPECT, table.boot_id, 2**64 - 1, accuser=c.peer_id)
        payload = await _send(c, a, lie)
        await _until(lambda: payload in seen, 30, "A to read the rumor")
        assert table.stats.rejected == rejected + 1  # dropped, as any malformed message
        assert table.incarnation < 2**32
        # A's clock runs on: B gets A's messages (probes, acks) after the lie
        heard = b.discovery.table.stats.messages_in
        sent = table.stats.messages_out
        b_entry = b.discovery.table.entries[a.peer_id]
        since = trio.current_time()
        await _until(
            lambda: table.stats.messages_out > sent + 3 and b_entry.last_heard > since,
            60,
            "A's gossip after the rumor",
        )
        assert b.discovery.table.stats.messages_in > heard
        assert b.discovery.table.health_of(a.peer_id) is Health.ALIVE
        assert a.discovery._encode_failures == 0


async def test_a_members_word_that_another_left_evicts_nobody(tmp_path: Path) -> None:
    """C tells A that B left (B never did). Before the fix A marked B ``left`` at once
    and ignored B's own messages after; now only B's own word counts, so B stays
    alive in A's table and A keeps hearing from B."""
    async with _three(tmp_path) as (a, b, c):
        seen = _processed(a)
        table = a.discovery.table
        b_entry = table.entries[b.peer_id]
        lie = Update(b.peer_id, Health.LEFT, b_entry.boot_id, b_entry.incarnation)
        payload = await _send(c, a, lie)
        await _until(lambda: payload in seen, 30, "A to read the rumor")
        assert table.health_of(b.peer_id) is Health.ALIVE
        since = trio.current_time()
        await _until(lambda: b_entry.last_heard > since, 60, "A to hear from B after it")
        assert table.health_of(b.peer_id) is Health.ALIVE
        assert b.peer_id in {m.peer_id for m in a.discovery.alive()}


async def test_a_boot_named_by_another_member_buries_nobody(tmp_path: Path) -> None:
    """C tells A that B runs a newer boot, then that this boot died. Before the fix A
    buried B for good (B's own messages, under its real boot, counted for nothing);
    now A waits for a record of that boot signed by B, which C cannot make."""
    async with _three(tmp_path) as (a, b, c):
        seen = _processed(a)
        table = a.discovery.table
        b_entry = table.entries[b.peer_id]
        future = b_entry.boot_id + 1
        first = await _send(c, a, Update(b.peer_id, Health.ALIVE, future, 0, 1, b_entry.addrs))
        second = await _send(c, a, Update(b.peer_id, Health.DEAD, future, 0))
        await _until(lambda: first in seen and second in seen, 30, "A to read both rumors")
        assert table.health_of(b.peer_id) is Health.ALIVE
        assert b_entry.boot_id == b.discovery.table.boot_id
        since = trio.current_time()
        await _until(lambda: b_entry.last_heard > since, 60, "A to hear from B after them")
        assert table.health_of(b.peer_id) is Health.ALIVE


async def test_a_message_that_cannot_be_encoded_is_dropped_not_raised(tmp_path: Path) -> None:
    """Whatever the membership core asks to send, the service never raises for a message
    it cannot encode: it logs it, drops it, and the clock goes on."""
    async with _three(tmp_path) as (a, b, _):
        table = a.discovery.table
        bad = Message(Kind.GOSSIP, a.peer_id, b.peer_id, table.boot_id, 2**64, 0)
        a.discovery._dispatch([bad])
        assert a.discovery._encode_failures == 1
        sent = table.stats.messages_out
        await _until(lambda: table.stats.messages_out > sent + 3, 60, "A's clock after it")
