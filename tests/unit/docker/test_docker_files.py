"""docker/: the compose file and the image agree with the CLI (no Docker engine needed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from hetmesh.cli import app
from hetmesh.node.config import check_settings

DOCKER = Path(__file__).resolve().parents[3] / "docker"
NODES = ("node0", "node1", "node2")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return data


def _command(*path: str) -> Any:
    """The click command behind ``hetmesh <path...>`` (typer builds it)."""
    cmd: Any = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _options(*path: str) -> set[str]:
    return {o for p in _command(*path).params for o in getattr(p, "opts", [])}


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_compose_has_three_nodes_and_a_model_pull(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(NODES) <= set(services)
    pull = services["model"]["command"]
    assert pull[:2] == ["model", "pull"]
    assert set(_flags(pull)) <= _options("model", "pull")
    for name in NODES:
        assert services[name]["depends_on"]["model"]["condition"] == (
            "service_completed_successfully"
        )


@pytest.mark.parametrize("name", NODES)
def test_node_commands_use_only_real_flags(compose: dict[str, Any], name: str) -> None:
    argv = [str(a) for a in compose["services"][name]["command"]]
    assert argv[:2] == ["node", "start"]
    known = _options("node", "start")
    unknown = set(_flags(argv)) - known
    assert not unknown, f"{name}: not options of `hetmesh node start`: {unknown}"
    # every value-taking flag has its value
    for flag in _flags(argv):
        param = next(p for p in _command("node", "start").params if flag in p.opts)
        if not getattr(param, "is_flag", False):
            value = _arg(argv, flag)
            assert value is not None
            assert not value.startswith("--"), f"{flag} has no value"
    assert _arg(argv, "--listen") == "/ip4/0.0.0.0/tcp/4001"
    assert _arg(argv, "--data-dir") == "/data"


def test_exactly_one_node_exposes_the_api_on_its_port(compose: dict[str, Any]) -> None:
    exposing = []
    for name in NODES:
        service = compose["services"][name]
        argv = [str(a) for a in service["command"]]
        port = _arg(argv, "--api-port")
        published = [str(p) for p in service.get("ports", [])]
        if port is None:
            assert not published, f"{name} publishes {published} without an API"
            continue
        exposing.append(name)
        assert any(p.split(":")[-1] == port for p in published), (name, port, published)
        health = [str(x) for x in service["healthcheck"]["test"]]
        assert _arg(health, "--api-port") == port  # its healthcheck asks the API
    assert exposing == ["node0"]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    exposed = re.search(r"^EXPOSE (.+)$", dockerfile, re.M)
    assert exposed is not None
    assert {"4001", "8000"} <= set(exposed.group(1).split())


@pytest.mark.parametrize("name", NODES)
def test_every_node_has_a_healthcheck_and_the_model_cache(
    compose: dict[str, Any], name: str
) -> None:
    service = compose["services"][name]
    assert service["healthcheck"]["test"][:3] == ["CMD", "python3", "/opt/hetmesh/healthcheck.py"]
    home = service["environment"]["HETMESH_HOME"]
    volumes = [str(v) for v in service["volumes"]]
    assert f"models:{home}" in volumes
    assert any(v.endswith(":/data") for v in volumes)  # identity survives restarts
    assert "models" in compose["volumes"]
    config = _arg([str(a) for a in service["command"]], "--config")
    assert any(v.split(":")[1] == config for v in volumes if v.startswith("./"))


def test_node_config_file_is_valid() -> None:
    settings = check_settings(tomllib.loads((DOCKER / "node.toml").read_text()), source="node.toml")
    # containers are separate hosts: no shm, no loopback TCP between them
    assert settings["backends"] == ["libp2p"]


def test_dockerfile_takes_a_base_image_and_runs_the_cli() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    arg = text.index("ARG BASE_IMAGE=")
    assert text.index("FROM ${BASE_IMAGE}") > arg
    assert "TORCH_INDEX_URL" in text
    assert 'ENTRYPOINT ["hetmesh"]' in text
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert cmd[:2] == ["node", "start"]
    assert set(_flags(cmd)) <= _options("node", "start")
    assert "HEALTHCHECK" in text
    assert "HETMESH_HOME=/models" in text


def test_healthcheck_script(tmp_path: Path) -> None:
    script = DOCKER / "healthcheck.py"

    def run() -> int:
        argv = [sys.executable, str(script), "--data-dir", str(tmp_path), "--api-port", "0"]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    assert run() == 1  # no node.json yet
    (tmp_path / "node.json").write_text(json.dumps({"peer_id": "p", "pid": os.getpid()}))
    assert run() == 0
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / "node.json").write_text(json.dumps({"pid": int(dead.stdout)}))
    assert run() == 1  # the node that wrote it is gone
