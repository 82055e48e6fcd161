"""A fork server for the tests' node processes (run as a script).

    python -m tests.integration.node_server FD

Every ``hetmesh node start`` of the suite used to begin in a fresh interpreter and
spend ~4 CPU-s importing torch, transformers' Llama and tokenizer modules, libp2p and
hetmesh before doing anything of its own; the suite starts a hundred nodes and more.
This server imports those once, then forks one node per request: each is still a
real, separate OS process (its own pid, memory, signals, trio run, sockets, log file
and exit status) running the CLI's own ``main`` with the node's argv; only the imports
are skipped. A fork is safe only when a single thread runs: the server counts its
threads after the imports and says so, and the test side starts nodes the ordinary
way if it ever is more than one.

The CLI and demo tests keep starting ``hetmesh node start`` as users do (a new
interpreter): see :class:`~tests.integration.discovery.discovery_nodes.NodeFactory`.

Protocol over the Unix socket ``FD``: the server first says ``"ready THREADS"``. Each
request is one message, a JSON object ``{"argv": [...], "cwd": ..., "env": {...}}``
(argv after ``hetmesh``; the node's whole environment) with the node's log file
descriptor attached (SCM_RIGHTS); the server answers ``"pid PID"``, and ``"exit PID
STATUS"`` when it reaps that node (STATUS as ``Popen.returncode`` reads it: negative
for a signal). When the test process closes its end, the server kills whatever it
still has and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

# what a serving node imports on its way up (read off `python -X importtime -m hetmesh
# node start --serve`); the first import of each costs the same in every node
PRELOAD = (
    "torch",
    "trio",
    "libp2p",
    "safetensors",
    "platformdirs",
    "transformers",
    "transformers.configuration_utils",
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_python",
    "transformers.models.auto.auto_factory",
    "transformers.models.encoder_decoder",
    "transformers.models.llama.modeling_llama",
    "transformers.masking_utils",
    "transformers.pytorch_utils",
    "transformers.modeling_layers",
    "transformers.generation.candidate_generator",
    "transformers.generation.stopping_criteria",
    "hetmesh.cli",
    "hetmesh.node.config",
    "hetmesh.discovery.host",
    "hetmesh.node.daemon",
    "hetmesh.node.gateway",
    "hetmesh.node.weights",
    "hetmesh.node.serving",
    "hetmesh.node.calibration",
    "hetmesh.partition.text",
    "hetmesh.partition.stage",
)


def thread_count() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    return len(os.listdir("/proc/self/task"))


def _run_node(request: dict[str, Any], log_fd: int) -> None:
    """In the forked child: become ``python -m hetmesh ARGV`` with output to ``log_fd``."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        # signal dispositions are the interpreter's own (SIGPIPE ignored, SIGINT raising):
        # the server changes none
        # the interpreter seeded these from the OS at import: each node draws its own
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = ["hetmesh", *request["argv"]]
        from hetmesh.cli import main

        try:
            main()
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            # as the interpreter does: die of the signal
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        # what the interpreter does on its way out: wait for threads, run atexit
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve(fd: int) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    sock.sendall(f"ready {thread_count()}\n".encode())
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
            if not msg:  # the test process closed its end: stop, killing what is left
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _run_node(request, fds[0])
            os.close(fds[0])
            children.add(pid)
            sock.sendall(f"pid {pid}\n".encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


class NodeServer:
    """The test side: starts the server process, forks nodes through it."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.node_server", str(theirs.fileno())],
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
            raise RuntimeError(f"the node server did not start (said {first!r})")
        self.threads = int(first[1])
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

    def start(self, argv: list[str], log_fd: int, env: dict[str, str]) -> ForkedNode:
        """Fork a node running ``hetmesh *argv`` in ``env``, its output on ``log_fd``."""
        request = json.dumps({"argv": argv, "cwd": self.cwd, "env": env}).encode()
        with self._lock, self._cond:
            socket.send_fds(self._sock, [request], [log_fd])
            if not self._cond.wait_for(lambda: self._pids, timeout=120):
                raise RuntimeError("the node server did not fork")
            pid = self._pids.pop(0)
        return ForkedNode(self, pid, argv)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """Stop the server (it kills any node left); the makefile holds the socket open,
        so shut it down rather than just close it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)


class ForkedNode:
    """What the tests use of ``subprocess.Popen``, for a node forked by the server."""

    def __init__(self, server: NodeServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.returncode(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"node {self.pid}", timeout or 0)
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


if __name__ == "__main__":
    serve(int(sys.argv[1]))
