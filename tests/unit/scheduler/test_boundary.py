"""The scheduler is pure: no trio, libp2p, torch, clocks, I/O or global randomness."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hetmesh.scheduler

PACKAGE = Path(hetmesh.scheduler.__file__).parent
ALLOWED = {
    "__future__",
    "collections",
    "dataclasses",
    "hashlib",  # the coordinator's successor is drawn by a salted hash
    "itertools",
    "json",
    "math",
    "random",  # only for the type of an explicit random.Random passed in
    "typing",
    "numpy",
    "hetmesh",
}
ALLOWED_HETMESH = ("hetmesh.scheduler", "hetmesh.resources", "hetmesh.errors")


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_scheduler_imports_only_pure_modules() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top in ALLOWED, f"{path.name} imports {name}"
            if top == "hetmesh":
                assert name.startswith(ALLOWED_HETMESH), f"{path.name} imports {name}"


def test_scheduler_uses_no_global_random_state() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "random"
            ):
                assert node.attr == "Random", f"{path.name} uses random.{node.attr}"


def test_importing_scheduler_loads_no_trio_libp2p_or_torch() -> None:
    code = (
        "import sys, hetmesh.scheduler, hetmesh.scheduler.synthetic, hetmesh.scheduler.bruteforce;"
        "print(','.join(m for m in ('trio', 'libp2p', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
