"""Talking to a mesh over libp2p as a light peer (it never announces itself).

```python
async with open_mesh_client("/ip4/127.0.0.1/tcp/4001/p2p/12D3...", mesh_secret=s) as mesh:
    async for event in mesh.stream(prompt="Once upon a time", max_new_tokens=20):
        print(event.text, end="")
```

The SDK (:mod:`hetmesh.client.sdk`) builds on :meth:`MeshClient.deltas`, which
applies a :class:`~hetmesh.client._base.Timeout`; :meth:`MeshClient.stream` is
the older event shape kept for scripts and tests.

This way in needs the mesh secret, a member's credential (it lets its holder
announce, gossip and sign as well): it is for the operator's own tools. A
client that may only generate and read status uses a node's HTTP API with its
API key (``AsyncClient(url=..., api_key=...)``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from hetmesh import errors
from hetmesh.client._base import Delta, Finish, Timeout, decode_reply, seconds
from hetmesh.discovery import wire
from hetmesh.discovery.host import derive_psk, dial, mesh_fingerprint, open_host, parse_peer_addr
from hetmesh.errors import (
    ConnectTimeout,
    MeshError,
    PeerUnreachable,
    RequestTimeout,
)
from hetmesh.protocol.generate import GENERATE_PROTOCOL, MAX_REQUEST_BYTES

NO_EXPIRY = 0  # libp2p's peerstore TTL that never expires

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int  # -1 for a final text-only flush
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class MeshClient:
    """A connection to one node of a mesh; requests enter the mesh there."""

    def __init__(
        self,
        host: Any,
        peer_id: Any,
        *,
        timeout_s: float = 60.0,
        timeout: Timeout | None = None,
        addrs: Sequence[Any] = (),
    ) -> None:
        self._host = host
        self._peer_id = peer_id
        self._addrs = list(addrs)  # where the node was dialled: a dropped connection redials
        self.timeout = timeout or Timeout(connect=timeout_s, first_token=timeout_s, total=None)
        self._per_read_s = timeout_s if timeout is None else None

    @property
    def peer_id(self) -> str:
        return str(self._peer_id)

    async def _open_stream(self, protocol: str, connect_s: float) -> Any:
        from libp2p.custom_types import TProtocol

        if self._addrs:
            # libp2p keeps a dialled peer's addresses for 120 s only: a connection the
            # node (or a network blip) closes later is redialled from these, with no
            # expiry ("No known addresses" otherwise, for the client's whole life)
            self._host.get_peerstore().add_addrs(self._peer_id, self._addrs, NO_EXPIRY)
        try:
            with trio.fail_after(connect_s):
                return await self._host.new_stream(self._peer_id, [TProtocol(protocol)])
        except trio.TooSlowError as exc:
            raise ConnectTimeout(f"opening {protocol} to {self.peer_id} timed out") from exc
        except MeshError:
            raise
        except Exception as exc:  # libp2p's errors, translated at this boundary
            raise PeerUnreachable(f"cannot open {protocol} to {self.peer_id}: {exc}") from exc

    async def deltas(
        self, request: dict[str, Any], limits: Timeout | None = None
    ) -> AsyncGenerator[Delta | Finish, None]:
        """:class:`Delta` per token, then one :class:`Finish`; errors raise from the tree.

        ``RequestTimeout`` when the first token or the whole stream is late,
        ``ConnectTimeout``/``PeerUnreachable`` when the node cannot be reached.
        """
        timeout = limits or self.timeout
        payload = wire.encode({k: v for k, v in request.items() if v is not None})
        if len(payload) > MAX_REQUEST_BYTES:
            raise errors.InvalidRequest(f"request of {len(payload)} bytes is too large")
        deadline = trio.current_time() + seconds(timeout.total)
        stream = await self._open_stream(GENERATE_PROTOCOL, seconds(timeout.connect))
        first = True
        reader = wire.FrameReader(stream)  # a read a token (tokens already there: none)
        try:
            await wire.write_frame(stream, payload)
            while True:
                left = deadline - trio.current_time()
                wait = min(left, seconds(timeout.first_token)) if first else left
                if self._per_read_s is not None:
                    wait = min(wait, self._per_read_s)
                try:
                    raw = await reader.read_frame(
                        max_bytes=MAX_REQUEST_BYTES, timeout_s=max(wait, 0.0)
                    )
                except trio.TooSlowError as exc:
                    what = "the first token" if first else "the end of the stream"
                    raise RequestTimeout(f"{what} did not arrive within {wait:.1f} s") from exc
                event = decode_reply(wire.decode_map(raw, max_bytes=MAX_REQUEST_BYTES))
                first = False
                yield event
                if isinstance(event, Finish):
                    return
        finally:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.close()

    async def stream(self, **request: Any) -> AsyncGenerator[TokenEvent | Finished, None]:
        """Token events, then one :class:`Finished`; errors raise from the tree."""
        async with contextlib.aclosing(self.deltas(request)) as events:
            async for event in events:
                if isinstance(event, Finish):
                    yield Finished(
                        event.finish_reason, event.prompt_tokens, event.completion_tokens
                    )
                    return
                yield TokenEvent(-1 if event.token_id is None else event.token_id, event.text)

    async def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The node's view of the mesh (the status RPC)."""
        stream = await self._open_stream(wire.STATUS_PROTOCOL, timeout_s)
        try:
            payload = await wire.read_frame(
                stream, max_bytes=wire.MAX_STATUS_BYTES, timeout_s=timeout_s
            )
        except trio.TooSlowError as exc:
            raise RequestTimeout(f"{self.peer_id} did not answer the status request") from exc
        finally:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.close()
        return wire.decode_map(payload, max_bytes=wire.MAX_STATUS_BYTES)


async def discover_mdns(mesh_secret: str | None, *, timeout_s: float = 5.0) -> str:
    """The address of a node heard of over mDNS on the LAN (``ConnectTimeout`` if none)."""
    from libp2p import generate_new_ed25519_identity

    from hetmesh.discovery.mdns import start_mdns, stop_mdns

    found: list[str] = []
    token = trio.lowlevel.current_trio_token()
    heard = trio.Event()

    def on_peer(_peer_id: str, addrs: tuple[str, ...]) -> None:  # a zeroconf thread
        found.extend(addrs)
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(heard.set, trio_token=token)

    async with open_host(
        generate_new_ed25519_identity(),
        psk=derive_psk(mesh_secret),
        listen=["/ip4/0.0.0.0/tcp/0"],
        dial_timeout_s=3.0,
    ) as host:
        mine = [f"{a}" for a in host.get_addrs()]
        handle = start_mdns(host, mine, mesh_fingerprint(mesh_secret), on_peer)
        try:
            with trio.move_on_after(timeout_s):
                await heard.wait()
        finally:
            # in this thread, as the daemon does: the mDNS service cancels its trio cleanup
            # task here, and a cancel from a worker thread can go unseen until that task's
            # 60 s sleep ends, holding the client's trio.run open (zeroconf's close blocks
            # a moment, with nothing else for this loop to do)
            stop_mdns(handle)
    if not found:
        raise ConnectTimeout(f"no hetmesh node answered over mDNS within {timeout_s:.1f} s")
    return found[0]


@contextlib.asynccontextmanager
async def open_mesh_client(
    addr: str | Sequence[str],
    *,
    mesh_secret: str | None = None,
    timeout_s: float = 60.0,
    limits: Timeout | None = None,
) -> AsyncIterator[MeshClient]:
    """Connect to the first node of ``addr`` (``/ip4/H/tcp/P/p2p/ID``, or several) that answers.

    Raises ``InvalidRequest`` for a malformed address, and the dial's error
    (``AuthenticationFailed``, ``PeerUnreachable``, ``ConnectTimeout``) of the
    last address tried when none answers.
    """
    from libp2p import generate_new_ed25519_identity

    addrs = [addr] if isinstance(addr, str) else list(addr)
    if not addrs:
        raise errors.InvalidRequest("no node address to connect to")
    try:
        infos = [parse_peer_addr(a) for a in addrs]
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from exc
    connect_s = seconds(limits.connect) if limits is not None else 5.0
    # a stream's protocol is agreed within the time a request may wait to connect: a
    # node too busy to answer in a dial's 3 s is slow, not gone (its link is open)
    negotiate_s = min(seconds(limits.connect) if limits is not None else timeout_s, 600.0)
    async with open_host(
        generate_new_ed25519_identity(),
        psk=derive_psk(mesh_secret),
        listen=["/ip4/127.0.0.1/tcp/0"],
        dial_timeout_s=min(connect_s, 3.0),
        negotiate_timeout_s=max(negotiate_s, 3.0),
    ) as host:
        chosen = None
        failure: MeshError | None = None
        for info in infos:
            try:
                await dial(host, info, timeout_s=connect_s)
            except MeshError as exc:
                log.info("could not reach %s: %s", info.peer_id, exc)
                failure = exc
                continue
            chosen = info
            break
        if chosen is None:
            assert failure is not None
            raise failure
        yield MeshClient(
            host, chosen.peer_id, timeout_s=timeout_s, timeout=limits, addrs=chosen.addrs
        )


__all__ = [
    "Finished",
    "MeshClient",
    "TokenEvent",
    "discover_mdns",
    "open_mesh_client",
]
