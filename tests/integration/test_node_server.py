"""The tests' node fork server behaves as a new ``python -m hetmesh`` would, where the
tests look: the child's own pid, its output in its log, its exit status and signals
as ``Popen.returncode`` reports them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.discovery.discovery_nodes import NodeFactory, node_env, node_server
from tests.integration.node_server import ForkedNode, NodeServer

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _server() -> NodeServer:
    server: NodeServer | None = node_server(node_env())
    if server is None:
        pytest.skip("nodes start as new interpreters here (HETMESH_TEST_FORK=0 or threads)")
    return server


def _run(
    server: NodeServer, tmp_path: Path, name: str, argv: list[str], env: dict[str, str]
) -> tuple[ForkedNode, Path]:
    log = tmp_path / f"{name}.log"
    with log.open("ab") as out:
        proc = server.start(argv, out.fileno(), env)
    return proc, log


def test_a_forked_command_exits_with_its_own_status_and_output(tmp_path: Path) -> None:
    server = _server()
    env = node_env()
    ok, ok_log = _run(server, tmp_path, "version", ["version"], env)
    bad, bad_log = _run(server, tmp_path, "bad", ["node", "start", "--no-such-flag"], env)
    assert ok.wait(timeout=120) == 0, ok_log.read_text()
    assert ok_log.read_text().strip(), "`hetmesh version` printed nothing into its log"
    assert bad.wait(timeout=120) == 2, bad_log.read_text()  # the CLI's usage error
    assert "no-such-flag" in bad_log.read_text()
    assert ok.pid != bad.pid
    assert os.getpid() not in (ok.pid, bad.pid)


def test_a_forked_node_stops_on_sigterm_and_dies_of_sigkill(tmp_path: Path) -> None:
    _server()
    factory = NodeFactory(tmp_path)
    try:
        loopback = ("--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0")
        first = factory.start(*loopback).wait_ready()
        second = factory.start(*loopback, "--bootstrap", first.addr).wait_ready()
        assert len({first.proc.pid, second.proc.pid, os.getpid()}) == 3
        os.kill(first.proc.pid, signal.SIGTERM)  # the CLI's graceful stop
        assert first.proc.wait(timeout=120) == 0, first.log()
        assert "node ready" in first.log()
        os.kill(second.proc.pid, signal.SIGKILL)
        assert second.proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        factory.close()
