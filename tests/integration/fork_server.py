"""What the tests' fork servers share: the server's loop and the test side's handles.

A fork server (``node_server.py``, ``transport/peer_server.py``) is a process that has
paid for the heavy imports once and forks one child per request: each child is still
a real, separate OS process (its own pid, memory, signals, sockets and exit status),
only without the imports. Fork is safe there because no thread runs in the server.

Protocol over a Unix socket: the server first says ``"ready [WORDS...]"``. Each request
is one message with one file descriptor attached (SCM_RIGHTS: the child's output); the
server answers ``"pid PID"``, and ``"exit PID STATUS"`` when it reaps that child
(STATUS as ``Popen.returncode`` reads it: negative for a signal). When the test
process closes its end, the server kills whatever children it still has and returns.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable


def serve_forks(
    sock: socket.socket,
    run_child: Callable[[bytes, int], None],
    *,
    max_message: int,
    poll_s: float,
) -> None:
    """The server's loop: fork ``run_child(message, fd)`` per request (it must not
    return: it ends with ``os._exit``), report pids and exits, stop when the test
    side closes its end."""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], poll_s)
        if readable:
            msg, fds, _, _ = socket.recv_fds(sock, max_message, 1)
            if not msg:  # the test process closed its end: stop, killing what is left
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            pid = os.fork()
            if pid == 0:
                sock.close()
                run_child(msg, fds[0])
                os._exit(1)  # run_child exits itself; never back into the loop
            os.close(fds[0])
            children.add(pid)
            sock.sendall(f"pid {pid}\n".encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


class ForkServer:
    """The test side: starts ``python -m MODULE FD`` and forks children through it."""

    def __init__(self, module: str, cwd: str, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            cwd=cwd,
            env=env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.cwd = cwd
        self._sock = ours
        self._lines = ours.makefile("r")
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        first = self._lines.readline().split()
        if not first or first[0] != "ready":
            raise RuntimeError(f"the fork server {module} did not start (said {first!r})")
        self.ready_words = first[1:]  # what the server said after "ready"
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

    def fork(self, message: bytes, fd: int, timeout: float) -> int:
        """Send one request with ``fd`` attached; the pid of the child it forked."""
        with self._lock, self._cond:
            socket.send_fds(self._sock, [message], [fd])
            if not self._cond.wait_for(lambda: self._pids, timeout=timeout):
                raise RuntimeError("the fork server did not fork")
            return self._pids.pop(0)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """Stop the server (it kills any child left); the makefile holds the socket open,
        so shut it down rather than just close it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)


class ForkedProcess:
    """What the tests use of ``subprocess.Popen``, for a child of a :class:`ForkServer`."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.returncode(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
