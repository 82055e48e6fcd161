"""The testbed leaves nothing behind when the code inside it fails."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hetmesh.testbed.cgroups import detect
from hetmesh.testbed.mesh import HostSpec, MeshNode, open_mesh_testbed, why_no_testbed
from hetmesh.testbed.netns import NETNS_DIR

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(120)]


class Boom(Exception):
    pass


@dataclass
class Seen:
    nodes: list[MeshNode] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)


def _fail_inside(tmp_path: Path, seen: Seen) -> None:
    specs = [HostSpec(cpu=0.5, memory_limit_bytes=1 << 30, rate="100mbit"), HostSpec()]
    with open_mesh_testbed(tmp_path, specs) as bed:
        seen.nodes.append(bed.start_node(0, "--no-serve"))
        seen.namespaces += [h.namespace for h in bed.net.hosts] + [bed.net.bridge_namespace]
        seen.cgroups += bed.net.hosts[0].cgroups
        hierarchy = detect()
        assert hierarchy is not None
        # v1: a cpu and a memory group; v2: one group with both
        assert len(seen.cgroups) == (2 if hierarchy.version == 1 else 1)
        assert all((NETNS_DIR / ns).exists() for ns in seen.namespaces)
        assert all(cg.exists() for cg in seen.cgroups)
        raise Boom


def test_a_failure_inside_tears_down_nodes_cgroups_and_namespaces(tmp_path: Path) -> None:
    reason = why_no_testbed()
    if reason:
        pytest.skip(reason)
    seen = Seen()
    with pytest.raises(Boom):
        _fail_inside(tmp_path, seen)
    (node,) = seen.nodes
    assert node.proc.poll() is not None  # killed by PID
    assert len(seen.namespaces) == 3
    assert not any((NETNS_DIR / ns).exists() for ns in seen.namespaces)
    assert not any(cg.exists() for cg in seen.cgroups)
