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

Protocol (tests/integration/fork_server.py): the server says ``"ready THREADS"``; a
request is a JSON object ``{"argv": [...], "cwd": ..., "env": {...}, "netns": ...,
"cgroups": [...]}`` (argv after ``hetmesh``; the node's whole environment; a testbed
host's network namespace and cgroups, or null and none) with the node's log file
descriptor attached.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

from tests.integration.fork_server import ForkedProcess, ForkServer, serve_forks

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


CLONE_NEWNET = 0x40000000


def thread_count() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    return len(os.listdir("/proc/self/task"))


def _enter(netns: str | None, cgroups: list[str]) -> None:
    """Join a testbed host: its network namespace (``setns``, as ``nsenter --net`` does; a
    forked child has one thread, and the threads it starts later inherit it) and cgroups."""
    if netns:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(netns, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns({netns}): {os.strerror(errno)}")
        finally:
            os.close(fd)
    for cgroup in cgroups:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))


def _run_node(request: dict[str, Any], log_fd: int) -> None:
    """In the forked child: become ``python -m hetmesh ARGV`` with output to ``log_fd``."""
    code = 1
    try:
        _enter(request.get("netns"), request.get("cgroups") or ())
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
    serve_forks(
        sock,
        lambda msg, log_fd: _run_node(json.loads(msg), log_fd),
        max_message=1 << 20,
        poll_s=0.1,
    )


class NodeServer(ForkServer):
    """The test side: starts the server process, forks nodes through it."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        super().__init__("tests.integration.node_server", cwd, env)
        self.threads = int(self.ready_words[0])

    def start(
        self,
        argv: list[str],
        log_fd: int,
        env: dict[str, str],
        *,
        netns: str | None = None,
        cgroups: tuple[str, ...] = (),
    ) -> ForkedNode:
        """Fork a node running ``hetmesh *argv`` in ``env``, its output on ``log_fd``; with
        ``netns`` and ``cgroups``, inside a testbed host (the child joins them first)."""
        request = {"argv": argv, "cwd": self.cwd, "env": env, "netns": netns, "cgroups": cgroups}
        message = json.dumps(request).encode()
        return ForkedNode(self, self.fork(message, log_fd, timeout=120), argv)


class ForkedNode(ForkedProcess):
    """A node forked by the server."""

    def __init__(self, server: NodeServer, pid: int, args: list[str]) -> None:
        super().__init__(server, pid)
        self.args = args


if __name__ == "__main__":
    serve(int(sys.argv[1]))
