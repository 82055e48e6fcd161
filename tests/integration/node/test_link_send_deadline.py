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


@pytest.mark.slow
async def test_a_send_to_a_peer_that_takes_nothing_times_out_and_closes_the_link():
    from hetmesh.discovery.host import dial, parse_peer_addr

    async with (
        open_peer(keep_frames=True) as (frozen, _, received),
        open_peer(keep_frames=False) as (host, pool, _),
    ):
        addr = f"{frozen.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{frozen.get_id()}"
        await dial(host, parse_peer_addr(addr), timeout_s=30)
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
    from hetmesh.discovery.host import dial, parse_peer_addr
    from hetmesh.discovery.table import Health, TableEvent

    async with (
        open_peer(keep_frames=False) as (remote, _, _),
        open_peer(keep_frames=False) as (host, pool, _),
    ):
        addr = f"{remote.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{remote.get_id()}"
        await dial(host, parse_peer_addr(addr), timeout_s=30)
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
