"""The other OS process in the transport integration tests (run as a script).

    python -m tests.integration.transport.transport_peer MODE BACKEND ADDRESS

It dials the test process (ADDRESS: a TCP port for the control stream, or a
libp2p multiaddr) and negotiates a link restricted to BACKEND. Modes:

* ``exchange`` — send :func:`payloads` as activations, then receive one frame
  and check it is :func:`reply`; exit 0 when bit-exact, 2 otherwise.
* ``echo`` — send every frame back until Goodbye.
* ``wrongcred`` — negotiate, then prove a forged credential; exit 3 when the
  listener refuses it with AuthenticationFailed, 1 otherwise.
* ``partial`` — start a 64 MiB frame, write part of it, print ``PARTIAL``
  and hang until killed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import trio

SIZES = (8 << 10, 4 << 20, 64 << 20)
DTYPES = (torch.float32, torch.bfloat16)


def payloads() -> list[torch.Tensor]:
    """Deterministic tensors of 8 KiB, 4 MiB and 64 MiB in float32 and bfloat16."""
    out = []
    for i, size in enumerate(SIZES):
        for j, dtype in enumerate(DTYPES):
            g = torch.Generator().manual_seed(10 * i + j)
            n = size // torch.empty(0, dtype=dtype).element_size()
            out.append(torch.randn(n, generator=g).to(dtype))
    return out


def reply() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(2 << 20, generator=g).to(torch.bfloat16)  # 4 MiB


def config(peer_id: str, backend: str) -> Any:
    from hetmesh.transport import DataPlaneConfig

    return DataPlaneConfig(peer_id=peer_id, backends=(backend,), gloo=True)


async def control_stream(backend: str, address: str, stack: Any) -> Any:
    if backend == "libp2p":
        from hetmesh.transport.p2p import open_p2p_host, p2p_connect

        host = await stack.enter_async_context(open_p2p_host())
        return await p2p_connect(host, address)
    return await trio.open_tcp_stream("127.0.0.1", int(address))


async def wrong_credential(plane: Any, control: Any, backend: str) -> int:
    from hetmesh.errors import AuthenticationFailed
    from hetmesh.transport import handshake
    from hetmesh.transport.credentials import Credential
    from hetmesh.transport.frames import Decision, Offer
    from hetmesh.transport.links import FramedStream
    from hetmesh.transport.negotiation import choose_backend

    framed = FramedStream(control)
    await framed.send(plane.offer())
    theirs = await framed.receive()
    assert isinstance(theirs, Offer)
    forged = Credential(theirs.credential_id, b"\0" * 32, plane.config.peer_id, theirs.peer_id)
    choice = choose_backend(plane.offer(), theirs)
    try:
        if backend == "libp2p":
            await framed.send(Decision(backend="libp2p", reason="test"))
            await handshake.dial_async(framed.send, framed.receive, forged)
        else:
            await plane._dial(choice, forged, theirs.peer_id)
    except AuthenticationFailed:
        return 3
    return 1


async def partial(link: Any) -> None:
    from hetmesh.transport import Activations
    from hetmesh.transport.frames import encode

    big = torch.ones(16 << 20, dtype=torch.float32)  # 64 MiB
    head, body = encode(Activations(session_id="s", step=0, positions=(0,), tensors=(big,)))
    if link.backend == "libp2p":
        await link._framed.stream.send_all(bytes(head) + bytes(memoryview(body)[: 8 << 20]))
    elif link.backend == "tcp":
        link.sock.sendall(head)
        link.sock.sendall(memoryview(body)[: 8 << 20])
    else:  # torchdist: the header, then never the payload; shm: nothing to split
        if link.backend == "torchdist":
            link.sock.sendall(head)
    print("PARTIAL", flush=True)
    await trio.sleep_forever()


async def main(mode: str, backend: str, address: str) -> int:
    from contextlib import AsyncExitStack

    from hetmesh.transport import Activations, Goodbye, open_data_plane

    torch.set_num_threads(1)
    async with AsyncExitStack() as stack:
        plane = await stack.enter_async_context(open_data_plane(config("child", backend)))
        control = await control_stream(backend, address, stack)
        if mode == "wrongcred":
            return await wrong_credential(plane, control, backend)
        link = await plane.connect(control)
        print("LINKED", link.backend, flush=True)
        if mode == "partial":
            await partial(link)
        if mode == "exchange":
            for i, t in enumerate(payloads()):
                await link.send(Activations(session_id="s", step=i, positions=(i,), tensors=(t,)))
            frame = await link.receive()
            ok = isinstance(frame, Activations) and frame == Activations(
                session_id="back", step=0, positions=(), tensors=(reply(),)
            )
            await link.aclose()
            return 0 if ok else 2
        if mode == "echo":
            while not isinstance(frame := await link.receive(), Goodbye):
                await link.send(frame)
                link.release(frame)
            await link.aclose()
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(trio.run(main, *sys.argv[1:4]))
