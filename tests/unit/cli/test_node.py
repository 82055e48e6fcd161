"""CLI pieces that are pure: status rendering, sizes, error unwrapping, imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetmesh.cli.node import first_mesh_error, parse_size
from hetmesh.cli.status import render_status
from hetmesh.errors import AuthenticationFailed

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaa1111"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbb2222"
C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCcccc3333"


def _peer(pid: str, health: str, ip: str, flops: float) -> dict[str, object]:
    return {
        "peer_id": pid,
        "health": health,
        "last_heard_s": 0.1,
        "record": {
            "peer_id": pid,
            "addrs": [f"/ip4/{ip}/tcp/4001/p2p/{pid}"],
            "devices": [
                {
                    "device": "cpu",
                    "memory_total_bytes": 8 << 30,
                    "memory_free_bytes": 3 << 30,
                    "matmul_flops": flops,
                    "memory_bandwidth_bps": 2e10,
                }
            ],
        },
    }


VIEW = {
    "self": A,
    "peers": [
        _peer(A, "self", "10.0.0.2", 1.5e11),
        _peer(B, "alive", "10.0.0.3", 2e10),
        _peer(C, "dead", "10.0.0.4", 0.0),
    ],
    "links": [
        {"src": A, "dst": B, "rtt_s": 0.00025, "bandwidth_bps": 12.5e6},
        {"src": B, "dst": A, "rtt_s": 0.0003, "bandwidth_bps": 1.2e9},
    ],
}


def test_status_render_lists_peers_devices_and_health() -> None:
    text = render_status(VIEW)
    for pid in (A, B, C):
        assert pid[-8:] in text
    assert "10.0.0.3:4001" in text
    assert "150.0 GFLOP/s" in text
    assert "3.0 GiB/8.0 GiB" in text
    assert "alive" in text
    assert "dead" in text


def test_status_render_link_matrix_has_measured_and_unknown_cells() -> None:
    text = render_status(VIEW)
    assert "0.25 ms, 12.5 MB/s" in text
    assert "0.30 ms, 1.2 GB/s" in text
    assert "?" in text  # A -> C was never measured


def test_status_render_copes_with_an_empty_view() -> None:
    assert "mesh seen from" in render_status({})


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 << 30), ("512M", 512_000_000), ("1000", 1000), ("1.5gi", 3 << 29), ("2 kb", 2000)],
)
def test_cli_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_cli_parse_size_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_cli_unwraps_mesh_errors_from_exception_groups() -> None:
    err = AuthenticationFailed("mesh secret differs")
    group = BaseExceptionGroup("g", [ValueError("x"), BaseExceptionGroup("h", [err])])
    assert first_mesh_error(group) is err
    assert first_mesh_error(ValueError("x")) is None


def test_discovery_never_imports_node() -> None:
    code = (
        "import sys, hetmesh.discovery.service, hetmesh.discovery.status, "
        "hetmesh.discovery.profiling; "
        "print(any(m.startswith('hetmesh.node') for m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=repo
    )
    assert out.stdout.strip() == "False"


def test_min_replicas_items_parse_or_name_the_bad_one() -> None:
    from hetmesh.cli.node import parse_min_replicas
    from hetmesh.errors import InvalidRequest

    assert parse_min_replicas(["a=2", "synth-tiny=1"]) == {"a": 2, "synth-tiny": 1}
    for bad in ("a", "=2", "a=two", "a=-1"):
        with pytest.raises(InvalidRequest, match=f"--min-replicas '{bad}'"):
            parse_min_replicas([bad])
