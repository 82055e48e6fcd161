"""A data-plane send to a peer that takes nothing has a deadline, and the link is
closed after it: two real libp2p hosts and data planes in this process, joined
by a same-host (shm) link whose receiver stops releasing what it is sent, as a
frozen process would. Its sender's small segment budget fills and the next send
would wait for ever without the deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from hetmesh.errors import PeerUnreachable
from hetmesh.transport import Activations
from tests.integration.node.inprocess_mesh import until

SECRET = "link-deadline"
SEND_TIMEOUT_S = 2.0
BUDGET_BYTES = 1 << 20  # four frames of 256 KiB


@asynccontextmanager
async def open_peer(*, keep_frames: bool) -> AsyncIterator[tuple[Any, Any, list[Any]]]:
    """A host, its data plane (shm only) and link pool; ``keep_frames``: never release."""
    from libp2p import generate_new_ed25519_identity

    from hetmesh.discovery.host import derive_psk, open_host
    from hetmesh.node.link_pool import DATAPLANE_PROTOCOL, LinkPool
    from hetmesh.transport import DataPlaneConfig, open_data_plane

    received: list[Any] = []
    async with (
        open_host(
            generate_new_ed25519_identity(),
            psk=derive_psk(SECRET),
            listen=["/ip4/127.0.0.1/tcp/0"],
        ) as host,
        open_data_plane(
            DataPlaneConfig(
                peer_id=str(host.get_id()), backends=("shm",), shm_budget_bytes=BUDGET_BYTES
            )
        ) as plane,
        trio.open_nursery() as nursery,
    ):

        def dispatch(peer: str, link: Any, frame: Any) -> None:
            received.append(frame)
            if not keep_frames:
                link.release(frame)

        pool = LinkPool(
            host=host,
            plane=plane,
            dispatch=dispatch,
            nursery=nursery,
            send_timeout_s=SEND_TIMEOUT_S,
        )
        from libp2p.custom_types import TProtocol

        host.set_stream_handler(TProtocol(DATAPLANE_PROTOCOL), pool.handle_incoming)
        yield host, pool, received
        nursery.cancel_scope.cancel()


async def connect(host: Any, remote: Any) -> str:
    """Dial ``remote`` from ``host``; its peer id."""
    from hetmesh.discovery.host import dial, parse_peer_addr

    addr = f"{remote.get_addrs()[0]}"
    if "/p2p/" not in addr:
        addr += f"/p2p/{remote.get_id()}"
    await dial(host, parse_peer_addr(addr), timeout_s=30)
    return str(remote.get_id())


@pytest.mark.slow
async def test_a_send_to_a_peer_that_takes_nothing_times_out_and_closes_the_link():
    async with (
        open_peer(keep_frames=True) as (frozen, _, received),
        open_peer(keep_frames=False) as (host, pool, _),
    ):
        await connect(host, frozen)
        peer = str(frozen.get_id())
        link = await pool.get(peer)
        assert link.backend == "shm", link.reason
        payload = torch.zeros(64 << 10)  # 256 KiB

        def frame(i: int) -> Activations:
            return Activations(session_id="s", step=i, positions=(0,), tensors=(payload,))

        fits = BUDGET_BYTES // payload.nbytes
        with trio.fail_after(120):  # far above the deadline: only a hang reaches it
            for i in range(fits):  # the segment budget holds these ...
                await pool.send(peer, frame(i))
            # ... and nothing is released: the next one would wait for ever
            with pytest.raises(PeerUnreachable, match=f"took over {SEND_TIMEOUT_S:g} s"):
                await pool.send(peer, frame(fits))
        assert peer not in pool.links()  # the link to it is closed ...
        assert pool.failures == 1
        assert len(received) <= fits  # nothing past the budget reached it


@pytest.mark.slow
async def test_the_link_of_a_peer_declared_dead_is_closed():
    from hetmesh.discovery.table import Health, TableEvent

    async with (
        open_peer(keep_frames=False) as (remote, _, _),
        open_peer(keep_frames=False) as (host, pool, _),
    ):
        await connect(host, remote)
        peer = str(remote.get_id())
        await pool.send(peer, Activations(session_id="s", step=0, positions=(), tensors=()))
        assert peer in pool.links()
        events_in, events = trio.open_memory_channel[TableEvent](8)
        await events_in.send(TableEvent("someone-else", Health.ALIVE, Health.SUSPECT))
        await events_in.send(TableEvent(peer, Health.SUSPECT, Health.DEAD))
        await events_in.aclose()
        heard: list[str] = []
        with trio.fail_after(30):
            await pool.close_dead(events, heard.append)  # returns when its events end
        assert heard == [peer]
        assert peer not in pool.links()


@pytest.mark.slow
@pytest.mark.parametrize("closes", [True, False], ids=["it-closes", "it-lingers"])
async def test_a_peer_that_left_is_read_until_its_link_ends(monkeypatch, closes: bool):
    """A draining node says goodbye, then sends what it still owes (a session's KV)
    and closes its links on exit: its link is read on until then, and closed after
    ``LEFT_LINGER_S`` if it never ends."""
    from hetmesh.discovery.table import Health, TableEvent
    from hetmesh.node import link_pool

    monkeypatch.setattr(link_pool, "LEFT_LINGER_S", 10.0 if closes else 0.5)
    async with (
        open_peer(keep_frames=False) as (remote, remote_pool, _),
        open_peer(keep_frames=False) as (host, pool, received),
    ):
        await connect(host, remote)
        peer, me = str(remote.get_id()), str(host.get_id())
        await pool.send(peer, Activations(session_id="s", step=0, positions=(), tensors=()))
        await until(lambda: me in remote_pool.links(), 30, "the remote holding the link")
        events_in, events = trio.open_memory_channel[TableEvent](8)
        await events_in.send(TableEvent(peer, Health.ALIVE, Health.LEFT))
        await events_in.aclose()
        heard: list[str] = []
        with trio.fail_after(30):
            await pool.close_dead(events, heard.append)
        assert heard == [peer]  # its sessions recover at once ...
        assert peer in pool.links()  # ... but its link is read on
        last = Activations(session_id="kv", step=1, positions=(), tensors=(torch.ones(4),))
        await remote_pool.send(me, last)
        await until(
            lambda: any(getattr(f, "session_id", "") == "kv" for f in received),
            30,
            "the frame it sent after leaving",
        )
        if closes:
            await remote_pool.drop(me)  # its exit closes the link
        began = trio.current_time()
        await until(lambda: peer not in pool.links(), 30, "the link closed")
        if closes:  # ended by its close, well before the linger
            assert trio.current_time() - began < link_pool.LEFT_LINGER_S
