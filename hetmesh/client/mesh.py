"""Talking to a mesh over libp2p as a light peer (it never announces itself).

```python
async with open_mesh_client("/ip4/127.0.0.1/tcp/4001/p2p/12D3...", mesh_secret=s) as mesh:
    async for event in mesh.stream(prompt="Once upon a time", max_new_tokens=20):
        print(event.text, end="")
```
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from hetmesh import errors
from hetmesh.client.protocol import GENERATE_PROTOCOL, MAX_REQUEST_BYTES
from hetmesh.discovery import wire
from hetmesh.discovery.host import derive_psk, dial, open_host, parse_peer_addr
from hetmesh.errors import ConnectTimeout, MeshError, RemoteProtocolError, RequestTimeout


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int  # -1 for a final text-only flush
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def _raise_remote(reply: dict[str, Any]) -> None:
    name = str(reply.get("error"))
    message = str(reply.get("message", ""))
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, MeshError):
        raise cls(message)
    raise MeshError(f"{name}: {message}")


class MeshClient:
    """A connection to one node of a mesh; requests enter the mesh there."""

    def __init__(self, host: Any, peer_id: Any, *, timeout_s: float) -> None:
        self._host = host
        self._peer_id = peer_id
        self._timeout_s = timeout_s

    async def stream(self, **request: Any) -> AsyncGenerator[TokenEvent | Finished, None]:
        """Token events, then one :class:`Finished`; errors raise from the tree."""
        from libp2p.custom_types import TProtocol

        payload = wire.encode({k: v for k, v in request.items() if v is not None})
        if len(payload) > MAX_REQUEST_BYTES:
            raise errors.InvalidRequest(f"request of {len(payload)} bytes is too large")
        try:
            with trio.fail_after(self._timeout_s):
                stream = await self._host.new_stream(self._peer_id, [TProtocol(GENERATE_PROTOCOL)])
        except trio.TooSlowError as exc:
            raise ConnectTimeout("opening the generate stream timed out") from exc
        try:
            await wire.write_frame(stream, payload)
            while True:
                try:
                    raw = await wire.read_frame(
                        stream, max_bytes=MAX_REQUEST_BYTES, timeout_s=self._timeout_s
                    )
                except trio.TooSlowError as exc:
                    raise RequestTimeout(f"no token for {self._timeout_s} s") from exc
                reply = wire.decode_map(raw, max_bytes=MAX_REQUEST_BYTES)
                if "error" in reply:
                    _raise_remote(reply)
                if reply.get("done"):
                    yield Finished(
                        str(reply.get("finish_reason", "")),
                        int(reply.get("prompt_tokens", 0)),
                        int(reply.get("completion_tokens", 0)),
                    )
                    return
                if "token" not in reply:
                    raise RemoteProtocolError(f"unexpected reply {sorted(reply)}")
                yield TokenEvent(int(reply["token"]), str(reply.get("text", "")))
        finally:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.close()


@contextlib.asynccontextmanager
async def open_mesh_client(
    addr: str, *, mesh_secret: str | None = None, timeout_s: float = 60.0
) -> AsyncIterator[MeshClient]:
    """Connect to the node at ``addr`` (``/ip4/H/tcp/P/p2p/ID``) for the block."""
    from libp2p import generate_new_ed25519_identity

    try:
        info = parse_peer_addr(addr)
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from exc
    async with open_host(
        generate_new_ed25519_identity(),
        psk=derive_psk(mesh_secret),
        listen=["/ip4/127.0.0.1/tcp/0"],
        dial_timeout_s=3.0,
    ) as host:
        await dial(host, info, timeout_s=5.0)
        yield MeshClient(host, info.peer_id, timeout_s=timeout_s)
