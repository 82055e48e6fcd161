"""A fork server for the transport tests' peer processes (run as a script).

    python -m tests.integration.transport.peer_server FD

Each ``transport_peer`` child used to start a fresh interpreter and import
torch, trio, libp2p and the transport before its first byte: ~2 CPU-s a child,
a dozen and more children a run. This server imports them once, then forks
one child per request: a real, separate OS process (its own pid, memory,
trio run and sockets), only without the imports. No thread runs here, so the
fork is safe.

Protocol (tests/integration/fork_server.py): a request is ``"MODE BACKEND
ADDRESS"`` with the write end of the child's stdout pipe attached.
:class:`ForkedPeer` is the test side's handle.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from typing import IO

from tests.integration.fork_server import ForkedProcess, ForkServer, serve_forks


def _run_child(args: list[str], stdout_fd: int) -> None:
    """In the forked child: stdout to the test's pipe, run the peer, exit with its code."""
    code = 1
    try:
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        import trio

        from tests.integration.transport import transport_peer

        code = trio.run(transport_peer.main, *args)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def serve(fd: int) -> None:
    import torch  # noqa: F401  (the imports every child would repeat)
    import trio  # noqa: F401

    import hetmesh.transport
    import hetmesh.transport.p2p  # noqa: F401
    from tests.integration.transport import transport_peer  # noqa: F401

    sock = socket.socket(fileno=fd)
    sock.sendall(b"ready\n")
    serve_forks(
        sock,
        lambda msg, out: _run_child(msg.decode().split(), out),
        max_message=4096,
        poll_s=0.05,
    )


class PeerServer(ForkServer):
    """The test side: starts the server process, forks peers through it."""

    def __init__(self, cwd: str) -> None:
        super().__init__("tests.integration.transport.peer_server", cwd)

    def start(self, mode: str, backend: str, address: str) -> ForkedPeer:
        read_fd, write_fd = os.pipe()
        try:
            pid = self.fork(f"{mode} {backend} {address}".encode(), write_fd, timeout=60)
        finally:
            os.close(write_fd)
        return ForkedPeer(self, pid, os.fdopen(read_fd, "r"))


class ForkedPeer(ForkedProcess):
    """A peer forked by the server, its stdout a pipe to the test."""

    def __init__(self, server: PeerServer, pid: int, stdout: IO[str]) -> None:
        super().__init__(server, pid)
        self.stdout: IO[str] | None = stdout


if __name__ == "__main__":
    serve(int(sys.argv[1]))
