"""Across NAT: members learn public / behind NAT; homes meet and serve through the relay.

One topology for the module: a public host and two homes behind masquerading
routers (hetmesh/testbed/nat.py) with 100 Mbit/s uplinks; a ``--no-serve`` node
on the public host and a serving node in each home, each home's memory too
small for the whole default model, so the plan splits it across the homes.
The home nodes bootstrap to the public one (the only address they can reach).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetmesh.nat.reachability import BEHIND_NAT, PUBLIC, link_kind, reach_of
from hetmesh.nat.relay import RELAY_KEY, RELAYED_KEY, VIA_KEY
from hetmesh.scheduler.records import Plan
from hetmesh.testbed.mesh import REPO, MeshNode, child_env, plan_of, wait_for
from hetmesh.testbed.nat import nat_unavailable_reason
from hetmesh.testbed.nat_mesh import NatMesh, open_nat_mesh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.model,
    pytest.mark.timeout(600),
]
HOME_ARGS = ("--max-memory", "600MiB", "--max-sessions", "4", "--max-context", "256")
NEW_TOKENS = 12
_REFERENCE = """
import json, sys, torch
torch.set_num_threads(1)
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import resolve_model
pipe = LocalPipeline.load(resolve_model())
ids = pipe.tokenizer.encode(sys.argv[1])
tokens = list(pipe.generate_ids(ids, SamplingParams(max_new_tokens=int(sys.argv[2]))))
print(json.dumps({"prompt": ids, "tokens": tokens}))
"""


@pytest.fixture(scope="module")
def nat_mesh(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[tuple[NatMesh, list[MeshNode]]]:
    reason = nat_unavailable_reason(need_tc=True)
    if reason:
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("nat")
    with open_nat_mesh(workdir, homes=2, rate="100mbit") as mesh:
        public, home0, home1 = mesh.bed.hosts
        first = mesh.start_node(public, "--no-serve").wait_up(240)
        homes = [mesh.start_node(h, *HOME_ARGS, bootstrap=first.addr) for h in (home0, home1)]
        nodes = [first, *(n.wait_up(300) for n in homes)]
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


def test_homes_serve_the_default_model_through_the_relay_like_one_process(
    nat_mesh: tuple[NatMesh, list[MeshNode]],
) -> None:
    mesh, nodes = nat_mesh
    _, home0, home1 = nodes
    ref = subprocess.run(
        [sys.executable, "-c", _REFERENCE, "The capital of France is", str(NEW_TOKENS)],
        capture_output=True,
        env=child_env(),
        cwd=REPO,
        timeout=240,
        check=True,
    )
    reference = json.loads(ref.stdout)

    def serving() -> Plan | None:
        view = mesh.status(mesh.bed.homes[0], home0)
        plan = plan_of(view)
        if plan is None:
            return None
        ready = {
            (str(p["peer_id"]), int(st["start"]), int(st["end"]))
            for p in view["peers"]
            for st in (p.get("record") or {}).get("stages") or ()
            if st.get("ready")
        }
        stages = {(s.peer_id, s.start, s.end) for s in plan.pipelines[0].stages}
        return plan if stages <= ready else None

    plan = wait_for(serving, 300, "a plan over both homes to be ready", every_s=2.0)
    # neither home holds the whole model: the pipeline crosses from one home to the other
    assert {s.peer_id for s in plan.pipelines[0].stages} == {home0.peer_id, home1.peer_id}
    argv = [
        sys.executable,
        "-m",
        "hetmesh.testbed.client",
        home0.addr,
        "--secret",
        mesh.secret,
        "--prompt-ids",
        ",".join(str(t) for t in reference["prompt"]),
        "--max-new-tokens",
        str(NEW_TOKENS),
    ]
    out = subprocess.run(
        mesh.bed.argv(mesh.bed.homes[0], argv),
        capture_output=True,
        env=child_env(),
        cwd=REPO,
        timeout=300,
    )
    lines = [json.loads(x) for x in out.stdout.decode().splitlines() if x.startswith("{")]
    assert lines, out.stderr.decode()[-3000:]
    assert "error" not in lines[0], lines[0]
    assert lines[0]["tokens"] == reference["tokens"]
    # the homes met over the relayed connection and the data-plane link between them
    # was hole-punched through both (cone) routers: no direct endpoint of the other
    # home was dialled blindly, and no link stayed on the relayed stream
    logs = home0.log() + home1.log()
    assert "the control connection is relayed" in logs
    assert "fell back after" not in logs
    assert "hole-punched" in logs
    assert "hole punching failed" not in logs

    # and status marks the homes' link hole-punched (each home announces it)
    def punched() -> bool:
        records = _records(mesh.status(mesh.bed.homes[0], home0))
        if not {home0.peer_id, home1.peer_id} <= records.keys():
            return False
        kind = link_kind(
            home0.peer_id, records[home0.peer_id], home1.peer_id, records[home1.peer_id]
        )
        return kind == "hole-punched"

    wait_for(punched, 60, "status to mark the homes' link hole-punched", every_s=2.0)
    # the link probe between them follows the data plane onto a punched path of its own
    # (hetmesh.nat.punch_probe), so the planner prices the path the tensors take
    wait_for(
        lambda: "measured over the hole-punched path" in home0.log() + home1.log(),
        150,
        "a link probe over the hole-punched path",
        every_s=2.0,
    )


def test_the_relayed_link_is_measured_over_the_relayed_path(
    nat_mesh: tuple[NatMesh, list[MeshNode]],
) -> None:
    mesh, nodes = nat_mesh
    _, home0, home1 = nodes
    pair = {(home0.peer_id, home1.peer_id), (home1.peer_id, home0.peer_id)}

    def measured() -> list[dict[str, Any]]:
        view = mesh.status(mesh.bed.homes[0], home0)
        return [lk for lk in view.get("links", []) if (lk["src"], lk["dst"]) in pair]

    links = wait_for(measured, 180, "a measured link between the homes", every_s=3.0)
    # the path crosses two 100 Mbit/s (12.5 MB/s) uplinks and the relay: the probe sees
    # the shaped rate at most (a token bucket's burst allowed for), not a LAN's
    for link in links:
        assert 0 < float(link["bandwidth_bps"]) < 1.3 * 12.5e6, link
        assert float(link["rtt_s"]) > 0
