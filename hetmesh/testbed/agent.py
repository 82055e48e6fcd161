"""A helper process that lives inside one testbed host and asks the mesh on request.

Tests and benchmarks read a node's view (``hetmesh status --json``) and run greedy
generations from inside a host's network namespace, often once a second while they
wait for a mesh to settle. A new Python process for each costs its imports (libp2p
alone ~1.3 CPU-s) every time; a host's agent imports once and serves every request
over its stdin and stdout, one JSON object a line each way::

    {"op": "status", "addr": ..., "secret": ..., "timeout_s": 30}
        -> {"ok": true, "view": {...}}            (what ``hetmesh status --json`` prints)
    {"op": "generate", "addr": ..., "secret": ..., "prompt_ids": [...],
     "max_new_tokens": 12, "repeat": 1}
        -> {"ok": true, "results": [...]}         (``hetmesh.testbed.client``'s lines)
    anything that fails -> {"ok": false, "error": "ExceptionName", "message": "..."}

:class:`HostAgent` is the test side: it starts the agent inside the host when first
asked, sends one request at a time, and kills the agent when a request outlives its
deadline (``subprocess.TimeoutExpired``, as ``subprocess.run`` would raise), so the
next request meets a fresh one.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import trio

# a request without its own deadline
DEFAULT_TIMEOUT_S = 60.0


async def _answer(request: dict[str, Any]) -> dict[str, Any]:
    from hetmesh.cli.status import sample_view
    from hetmesh.testbed.client import generations

    op = request.get("op")
    timeout_s = float(request.get("timeout_s", DEFAULT_TIMEOUT_S))
    secret = request.get("secret")
    if op == "status":
        view = await sample_view(
            str(request["addr"]), mesh_secret=secret, timeout_s=timeout_s, interval_s=0
        )
        return {"ok": True, "view": json.loads(json.dumps(view, default=str))}
    if op == "generate":
        results = await generations(
            str(request["addr"]),
            secret=str(secret),
            prompt_ids=[int(t) for t in request["prompt_ids"]],
            max_new_tokens=int(request["max_new_tokens"]),
            repeat=int(request.get("repeat", 1)),
        )
        return {"ok": True, "results": results}
    raise ValueError(f"unknown op {op!r}")


async def _serve() -> None:
    from hetmesh.discovery.host import configure_libp2p_logging

    configure_libp2p_logging()
    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return  # the test side closed our stdin: done
        try:
            reply = await _answer(json.loads(line))
        except Exception as exc:  # an answer, whatever went wrong; the agent lives on
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)[-3000:]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class HostAgent:
    """The test side of one host's agent; ``argv_in_host`` wraps a command to run there."""

    def __init__(
        self,
        argv_in_host: Callable[[Sequence[str]], list[str]],
        *,
        env: dict[str, str],
        cwd: Path,
        name: str,
    ) -> None:
        self._argv_in_host = argv_in_host
        self._env = env
        self._cwd = cwd
        self.name = name
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None

    def _started(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        argv = self._argv_in_host([sys.executable, "-m", "hetmesh.testbed.agent"])
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            cwd=str(self._cwd),
            text=True,
        )
        return self._proc

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    def request(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request's reply; ``RuntimeError`` for a failed one, ``TimeoutExpired`` late."""
        proc = self._started()
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({**payload, "timeout_s": timeout_s}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            raise RuntimeError(f"the agent in {self.name} died:\n{self._stderr_tail()}") from None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while not selector.select(max(deadline - time.monotonic(), 0)):
                if time.monotonic() >= deadline:
                    self.close()  # it may still answer later: never read a stale reply
                    raise subprocess.TimeoutExpired(["hetmesh.testbed.agent", self.name], timeout_s)
        line = proc.stdout.readline()
        if not line:
            tail = self._stderr_tail()
            self.close()
            raise RuntimeError(f"the agent in {self.name} died:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"{payload.get('op')} in {self.name} failed: {reply}")
        return reply

    def status(self, addr: str, secret: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """What ``hetmesh status --mesh ADDR --json`` prints, asked from inside the host."""
        reply = self.request({"op": "status", "addr": addr, "secret": secret}, timeout_s)
        view: dict[str, Any] = reply["view"]
        return view

    def generate(
        self,
        addr: str,
        secret: str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        repeat: int = 1,
        timeout_s: float = 300.0,
    ) -> list[dict[str, Any]]:
        """Greedy generations entering at ``addr`` (``hetmesh.testbed.client``'s results)."""
        payload = {
            "op": "generate",
            "addr": addr,
            "secret": secret,
            "prompt_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "repeat": repeat,
        }
        results: list[dict[str, Any]] = self.request(payload, timeout_s)["results"]
        return results

    def close(self) -> None:
        """Stop the agent (it ends when its stdin closes; killed if it does not)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class HostAgents:
    """One :class:`HostAgent` per host, started on first use; :meth:`close` stops them."""

    def __init__(
        self,
        argv_in_host: Callable[[Any, Sequence[str]], list[str]],
        *,
        env: dict[str, str],
        cwd: Path,
    ) -> None:
        self._argv_in_host = argv_in_host
        self._env = env
        self._cwd = cwd
        self._agents: dict[str, HostAgent] = {}

    def __call__(self, host: Any, name: str) -> HostAgent:
        agent = self._agents.get(name)
        if agent is None:
            agent = HostAgent(
                lambda argv: self._argv_in_host(host, argv), env=self._env, cwd=self._cwd, name=name
            )
            self._agents[name] = agent
        return agent

    def close(self) -> None:
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trio.run(_serve)


if __name__ == "__main__":
    main()


__all__ = ["HostAgent", "HostAgents"]
