"""Across NAT: members learn public / behind NAT; homes meet through the public relay.

One topology for the module: a public host and two homes behind masquerading
routers (hetmesh/testbed/nat.py), one ``--no-serve`` node in each; the home
nodes bootstrap to the public one (the only address they can reach).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetmesh.nat.reachability import BEHIND_NAT, PUBLIC, reach_of
from hetmesh.nat.relay import RELAY_KEY, RELAYED_KEY, VIA_KEY
from hetmesh.testbed.mesh import MeshNode
from hetmesh.testbed.nat import nat_unavailable_reason
from hetmesh.testbed.nat_mesh import NatMesh, open_nat_mesh

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def nat_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatMesh, list[MeshNode]]]:
    reason = nat_unavailable_reason()
    if reason:
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("nat")
    with open_nat_mesh(workdir, homes=2) as mesh:
        public, home0, home1 = mesh.bed.hosts
        first = mesh.start_node(public, "--no-serve").wait_up(180)
        homes = [mesh.start_node(h, "--no-serve", bootstrap=first.addr) for h in (home0, home1)]
        nodes = [first, *(n.wait_up(180) for n in homes)]
        try:
            yield mesh, nodes
        except BaseException:
            for node in nodes:
                print(f"--- {node.host} ---\n{node.log()[-3000:]}")
            raise


def _reach_by_peer(view: dict[str, Any]) -> dict[str, str]:
    return {str(p["peer_id"]): reach_of(p.get("record") or {}) for p in view.get("peers", [])}


def test_members_learn_public_or_behind_nat(nat_mesh: tuple[NatMesh, list[MeshNode]]) -> None:
    mesh, nodes = nat_mesh
    public_node, *home_nodes = nodes
    want = {public_node.peer_id: PUBLIC, **{n.peer_id: BEHIND_NAT for n in home_nodes}}
    deadline = time.monotonic() + 120
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        seen = _reach_by_peer(mesh.status(mesh.bed.public, public_node))
        if seen == want:
            break
        time.sleep(1.0)
    assert seen == want
    # a home node sees the same verdicts (they travel in the signed records)
    home_view = mesh.status(mesh.bed.homes[0], home_nodes[0])
    home_seen = _reach_by_peer(home_view)
    assert home_seen[public_node.peer_id] == PUBLIC
    assert home_seen[home_nodes[0].peer_id] == BEHIND_NAT
    # with a public member in the mesh, nobody is told to go and find one
    assert all("no member of the mesh is publicly reachable" not in n.log() for n in nodes)


def _records(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(p["peer_id"]): dict(p.get("record") or {}) for p in view.get("peers", [])}


def test_homes_reach_each_other_through_the_public_relay(
    nat_mesh: tuple[NatMesh, list[MeshNode]],
) -> None:
    mesh, nodes = nat_mesh
    public_node, home0, home1 = nodes
    deadline = time.monotonic() + 150
    records: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        view = mesh.status(mesh.bed.homes[0], home0)
        records = _records(view)
        health = {str(p["peer_id"]): p.get("health") for p in view.get("peers", [])}
        extra = {pid: r.get("extra") or {} for pid, r in records.items()}
        # the homes' connection runs through the relay (each announces whom it reaches so)
        relayed = home1.peer_id in (extra.get(home0.peer_id, {}).get(RELAYED_KEY) or ()) or (
            home0.peer_id in (extra.get(home1.peer_id, {}).get(RELAYED_KEY) or ())
        )
        if (
            extra.get(public_node.peer_id, {}).get(RELAY_KEY) == 1
            and extra.get(home0.peer_id, {}).get(VIA_KEY) == public_node.peer_id
            and extra.get(home1.peer_id, {}).get(VIA_KEY) == public_node.peer_id
            and health.get(home1.peer_id) == "alive"
            and relayed
        ):
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"no relayed link between the homes: {records}")
    # the public node relays, it does not need one
    assert not (records[public_node.peer_id].get("extra") or {}).get(VIA_KEY)
