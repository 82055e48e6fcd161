"""The NAT package's pure cores import neither trio nor libp2p (table-tested, no I/O)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "hetmesh.nat.reachability",
        "hetmesh.nat.relay_limits",
        "hetmesh.nat.punch_plan",
        "hetmesh.nat.state",
        "hetmesh.node.outcomes",
        "hetmesh.node.hop",
    ],
)
def test_nat_pure_cores_import_no_trio_or_libp2p(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'libp2p')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
