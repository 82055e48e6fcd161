"""The testbed's nodes negotiate their data plane as real hosts do, unless a spec asks.

``MeshTestbed.start_node`` against a recording stand-in for the namespaces (pure
logic: no root, no processes): the node's config file forces no backend by
default, and exactly the spec's backends when it names some.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from hetmesh.testbed.mesh import HostSpec, MeshTestbed


class _Host:
    ip = "10.0.0.2"


class _Net:
    hosts = (_Host(), _Host())

    def __init__(self) -> None:
        self.started: list[list[str]] = []

    def popen(self, host: int, argv: list[str], **kwargs: Any) -> Any:
        self.started.append(argv)
        return object()


def _config_of(tmp_path: Path, spec: HostSpec) -> dict[str, Any]:
    net = _Net()
    bed = MeshTestbed(net, (spec, spec), tmp_path, "secret")  # type: ignore[arg-type]
    bed.start_node(0)
    (argv,) = net.started
    config = Path(argv[argv.index("--config") + 1])
    return tomllib.loads(config.read_text())


def test_testbed_node_uses_the_default_data_plane(tmp_path: Path) -> None:
    assert "backends" not in _config_of(tmp_path, HostSpec())


def test_testbed_node_forces_libp2p_when_the_spec_asks(tmp_path: Path) -> None:
    assert _config_of(tmp_path, HostSpec(backends=("libp2p",)))["backends"] == ["libp2p"]
