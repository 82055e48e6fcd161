"""A data-plane link between two NAT testbed homes, hole-punched and sealed, timed.

``python -m hetmesh.testbed.nat_link splice HOST PORT`` (on the public host)
joins the first two TCP connections it accepts byte for byte: the stand-in
for the relayed libp2p connection two homes meet over (both dial out to it,
which their routers allow). ``python -m hetmesh.testbed.nat_link dial|accept
PUBLIC PORT HOME_IP ROUTER_IP MIB ROUNDS`` (one in each home) opens a
:class:`~hetmesh.transport.dataplane.DataPlane` on the home's address, tells
it the public IP its router gives it, and negotiates a link over that control
stream exactly as two nodes do over a relayed connection: offers with punch
candidates, simultaneous opens through both routers, the one-time credential
proven on the punched socket, the link sealed (AES-256-GCM, ``always``). The
dialer then sends ``ROUNDS`` activations of ``MIB`` MiB each and times them
to the acceptor's acknowledgement. Each side prints one JSON line: the link's
backend, whether it is sealed, the negotiation's reason and (dialer) seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Any

import trio

CHUNK = 256 * 1024


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        while data := await src.receive_some(CHUNK):
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        scope.cancel()


async def splice(host: str, port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    print("ready", flush=True)
    first = await listeners[0].accept()
    second = await listeners[0].accept()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump, first, second, nursery.cancel_scope)
        nursery.start_soon(_pump, second, first, nursery.cancel_scope)


class RelayedControl:
    """A trio stream that reads as a relayed libp2p stream to the negotiation."""

    def __init__(self, stream: trio.SocketStream) -> None:
        from libp2p.connection_types import ConnectionType

        self._stream = stream
        # hetmesh.transport.p2p.connection_is_relayed looks for this under ``stream``
        self.stream = SimpleNamespace(_connection_type=ConnectionType.RELAYED)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(memoryview(data))

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._stream.aclose()


async def home(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hetmesh.nat.state import NatState
    from hetmesh.transport.dataplane import DataPlaneConfig, open_data_plane
    from hetmesh.transport.frames import Activations, Tokens

    config = DataPlaneConfig(
        peer_id=f"home-{args.role}",
        backends=("tcp", "libp2p"),
        tcp_host=args.home_ip,
        tcp_encryption="always",
        nat=NatState(public_ip=args.router_ip),
    )
    async with open_data_plane(config) as plane:
        control = RelayedControl(await trio.open_tcp_stream(args.public, args.port))
        if args.role == "dial":
            link = await plane.connect(control)
        else:
            link = await plane.accept(control)
        out: dict[str, Any] = {
            "backend": link.backend.value,
            "encrypted": bool(getattr(link, "encrypted", False)),
            "reason": link.reason,
        }
        payload = torch.zeros(args.mib << 18, dtype=torch.float32)  # MIB MiB
        with trio.fail_after(600):
            if args.role == "dial":
                began = time.perf_counter()
                for step in range(args.rounds):
                    frame = Activations(
                        session_id="b", step=step, positions=(0,), tensors=(payload,)
                    )
                    await link.send(frame)
                ack = await link.receive()
                out["seconds"] = time.perf_counter() - began
                out["acked"] = isinstance(ack, Tokens)
            else:
                got = 0
                for _ in range(args.rounds):
                    received = await link.receive()
                    if isinstance(received, Activations):
                        got += sum(t.numel() * t.element_size() for t in received.tensors)
                await link.send(Tokens(session_id="b", step=0, token_ids=(1,)))
                out["received"] = got
                await trio.sleep(1.0)  # let the acknowledgement leave before closing
        out["bytes"] = args.rounds * (args.mib << 20)
        await link.aclose()
        await control.aclose()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("splice", "dial", "accept"))
    parser.add_argument("public")
    parser.add_argument("port", type=int)
    parser.add_argument("home_ip", nargs="?", default="")
    parser.add_argument("router_ip", nargs="?", default="")
    parser.add_argument("mib", nargs="?", type=int, default=4)
    parser.add_argument("rounds", nargs="?", type=int, default=8)
    args = parser.parse_args()
    if args.role == "splice":
        trio.run(splice, args.public, args.port)
        return
    print(json.dumps(trio.run(home, args)), flush=True)


if __name__ == "__main__":
    main()
