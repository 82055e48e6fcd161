"""hetmesh/speculative is a pure core: no trio or libp2p anywhere; the budget not even
torch or a clock (deterministic given what it was told)."""

from __future__ import annotations

import ast
from pathlib import Path

import hetmesh.speculative

PACKAGE = Path(hetmesh.speculative.__file__).parent


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_trio_or_libp2p() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 3
    for path in files:
        assert not imports_of(path) & {"trio", "libp2p"}, path.name


def test_the_budget_has_no_clock_and_no_device() -> None:
    assert imports_of(PACKAGE / "budget.py") <= {
        "__future__",
        "collections",
        "dataclasses",
        "hetmesh",
    }
