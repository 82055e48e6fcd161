"""The ``mesh_testbed`` fixture: emulated hosts for real nodes, torn down whatever happens.

``mesh_testbed(specs)`` builds one host per :class:`~hetmesh.testbed.mesh.HostSpec`
(namespaces, tbf, cgroups) and returns its :class:`~hetmesh.testbed.mesh.MeshTestbed`;
start nodes with ``start_all``/``start_node``. Skips with the reason where the
machine cannot (no root, ``tc``, a cgroup v1/v2 controller, or nsenter). On failure the nodes'
log tails are printed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from hetmesh.testbed.mesh import (
    HostSpec,
    MakeTestbed,
    MeshTestbed,
    open_mesh_testbed,
    why_no_testbed,
)
from tests.integration.discovery.discovery_nodes import forked_spawn
from tests.integration.reports import call_failed


@pytest.fixture
def mesh_testbed(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeTestbed]:
    reason = why_no_testbed()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        beds: list[MeshTestbed] = []

        def make(specs: Sequence[HostSpec]) -> MeshTestbed:
            workdir = tmp_path / f"bed{len(beds)}"
            workdir.mkdir()
            bed = stack.enter_context(open_mesh_testbed(workdir, specs))
            bed.spawn = forked_spawn  # nodes forked into their hosts: no interpreter start-up
            beds.append(bed)
            return bed

        try:
            yield make
        finally:
            if call_failed(request):
                for bed in beds:
                    for node in bed.nodes:
                        print(f"--- host {node.host} ---\n{node.log()[-3000:]}")
