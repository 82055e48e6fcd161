"""A membership-only node (``--no-serve``) never imports torch (seconds at start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetmesh.discovery import profiling

REPO = Path(__file__).resolve().parents[3]

# what `hetmesh node start --no-serve` loads before and while joining, and what its
# profiling reads when the CPU benchmark is cached and no NVIDIA driver is loaded
_SCRIPT = """
import sys
import hetmesh.cli, hetmesh.node.config, hetmesh.node.daemon, hetmesh.discovery.service
from hetmesh.cli.node import build_node_config
from hetmesh.discovery import profiling
config = build_node_config({"serve": False, "data_dir": "/nonexistent"})
assert config.serving is None
profiling.machine_key(profiling.read_cgroup_limits())
if not profiling._nvidia_driver_present():
    assert profiling.measure_gpu_flops() == {}
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(",".join(loaded[:5]))
"""


def test_membership_only_node_path_does_not_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""  # no torch module loaded


def test_machine_key_names_the_installed_torch_version() -> None:
    torch = pytest.importorskip("torch")
    key = profiling.machine_key(profiling.read_cgroup_limits())
    assert key.endswith(f"torch={torch.__version__}")  # caches written before stay valid
