"""One end of a tcp link between two network namespaces (run as a script).

    python -m tests.integration.transport.sealed_peer listen IP PORT
    python -m tests.integration.transport.sealed_peer dial IP PORT

``listen`` serves a data plane on ``IP`` and takes one control connection on
``PORT``, then echoes frames until Goodbye. ``dial`` connects to it, sends
:func:`payloads`, checks each echo bit for bit and prints ``SEALED <bool>``;
exit 0 when every echo matched. Both ends use the default ``tcp_encryption``.
"""

from __future__ import annotations

import sys

import torch
import trio


def payloads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(n, generator=g) for n in (2 << 10, 1 << 20, 3 << 20)]


async def listen(ip: str, port: int) -> int:
    from hetmesh.transport import DataPlaneConfig, Goodbye, open_data_plane

    async with open_data_plane(
        DataPlaneConfig(peer_id="listener", backends=("tcp",), tcp_host=ip)
    ) as plane:
        listener = (await trio.open_tcp_listeners(port, host=ip))[0]
        print("READY", flush=True)
        control = await listener.accept()
        link = await plane.accept(control)
        while True:
            frame = await link.receive()
            if isinstance(frame, Goodbye):
                break
            await link.send(frame)
            link.release(frame)
        await link.aclose()
    return 0


async def dial(ip: str, port: int) -> int:
    from hetmesh.transport import Activations, DataPlaneConfig, open_data_plane

    async with open_data_plane(
        DataPlaneConfig(peer_id="dialer", backends=("tcp",), tcp_host="0.0.0.0")
    ) as plane:
        with trio.fail_after(60):
            control = await trio.open_tcp_stream(ip, port)
            link = await plane.connect(control)
        print("SEALED", getattr(link, "encrypted", None), flush=True)
        ok = True
        for step, t in enumerate(payloads()):
            await link.send(Activations(session_id="s", step=step, positions=(0,), tensors=(t,)))
            back = await link.receive()
            ok = ok and back == Activations(session_id="s", step=step, positions=(0,), tensors=(t,))
            link.release(back)
        await link.aclose()
    return 0 if ok else 2


if __name__ == "__main__":
    mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.exit(trio.run(listen if mode == "listen" else dial, ip, port))
