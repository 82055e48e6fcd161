"""A fork server for the transport tests' peer processes (run as a script).

    python -m tests.integration.transport.peer_server FD

Each ``transport_peer`` child used to start a fresh interpreter and import
torch, trio, libp2p and the transport before its first byte: ~2 CPU-s a child,
a dozen and more children a run. This server imports them once, then forks
one child per request: a real, separate OS process (its own pid, memory,
trio run and sockets), only without the imports. No thread runs here, so the
fork is safe.

Protocol over the Unix socket ``FD`` (one request a message): the test sends
``"MODE BACKEND ADDRESS"`` with the write end of the child's stdout pipe
attached (SCM_RIGHTS); the server answers ``"pid PID"``, and ``"exit PID
STATUS"`` when it reaps that child (STATUS as ``Popen.returncode`` reads:
negative for a signal). :class:`ForkedPeer` is the test side's handle.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import threading
import traceback
from typing import IO


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
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            if not msg:  # the test process closed its end: stop, killing what is left
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                return
            pid = os.fork()
            if pid == 0:
                sock.close()
                _run_child(msg.decode().split(), fds[0])
            os.close(fds[0])
            children.add(pid)
            sock.sendall(f"pid {pid}\n".encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


class PeerServer:
    """The test side: starts the server process, forks peers through it."""

    def __init__(self, cwd: str) -> None:
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.transport.peer_server", str(theirs.fileno())],
            cwd=cwd,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._sock = ours
        self._lines = ours.makefile("r")
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        first = self._lines.readline()
        if first != "ready\n":
            raise RuntimeError(f"the peer server did not start (said {first!r})")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._lines:
            kind, pid, *rest = line.split()
            with self._cond:
                if kind == "pid":
                    self._pids.append(int(pid))
                else:
                    self._exits[int(pid)] = int(rest[0])
                self._cond.notify_all()

    def start(self, mode: str, backend: str, address: str) -> ForkedPeer:
        read_fd, write_fd = os.pipe()
        try:
            with self._cond:
                socket.send_fds(self._sock, [f"{mode} {backend} {address}".encode()], [write_fd])
                if not self._cond.wait_for(lambda: self._pids, timeout=60):
                    raise RuntimeError("the peer server did not fork")
                pid = self._pids.pop(0)
        finally:
            os.close(write_fd)
        return ForkedPeer(self, pid, os.fdopen(read_fd, "r"))

    def _returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server (it kills any child left); the makefile holds the socket open,
        so shut it down rather than just close it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except Exception:
            self._proc.kill()
            self._proc.wait(timeout=30)


class ForkedPeer:
    """What the tests use of ``subprocess.Popen``, for a child of the peer server."""

    def __init__(self, server: PeerServer, pid: int, stdout: IO[str]) -> None:
        self._server = server
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._server._returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server._returncode(self.pid, timeout)
        if code is None:
            import subprocess

            raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout or 0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
