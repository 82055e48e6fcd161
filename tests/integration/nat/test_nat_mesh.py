"""Across NAT: members learn public / behind NAT; homes meet and serve through the relay.

One topology for the module: a public host and three homes behind masquerading
routers (hetmesh/testbed/nat.py) with 100 Mbit/s uplinks; a ``--no-serve`` node
on the public host and a serving node in homes 0 and 1, each home's memory too
small for the whole default model, so the plan splits it across the homes.
Home 2's router is symmetric (a fresh public port per destination) and its
node is ``--no-serve``: it shows where hole punching fails (a cheap node, no
model). The home nodes bootstrap to the public one (the only address they can
reach).
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

from hetmesh.nat.reachability import BEHIND_NAT, PUBLIC, link_kind, reach_of, reach_text
from hetmesh.nat.relay import RELAY_KEY, RELAYED_KEY, VIA_KEY
from hetmesh.scheduler.records import Plan
from hetmesh.testbed.mesh import REPO, MeshNode, child_env, plan_of, wait_for
from hetmesh.testbed.nat import nat_unavailable_reason
from hetmesh.testbed.nat_mesh import NatMesh, open_nat_mesh
from tests.integration.discovery.discovery_nodes import forked_spawn
from tests.integration.reports import print_logs_if_failed

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.model,
    pytest.mark.timeout(600),
]
# float32: the homes' memory is sized so that its weights need them (the default model's
# own int4 would fit one node)
HOME_ARGS = (
    *("--max-memory", "600MiB", "--max-sessions", "4", "--max-context", "256"),
    *("--weights", "float32"),
)
NEW_TOKENS = 12
_REFERENCE = """
import json, sys, torch
torch.set_num_threads(1)
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import resolve_model
pipe = LocalPipeline.load(resolve_model(), weights="float32")
ids = pipe.tokenizer.encode(sys.argv[1])
tokens = list(pipe.generate_ids(ids, SamplingParams(max_new_tokens=int(sys.argv[2]))))
print(json.dumps({"prompt": ids, "tokens": tokens}))
"""
LONG_TOKENS = 48


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The single process's greedy ``LONG_TOKENS`` for the prompt (a shorter greedy run
    is a prefix of it)."""
    ref = subprocess.run(
        [sys.executable, "-c", _REFERENCE, "The capital of France is", str(LONG_TOKENS)],
        capture_output=True,
        env=child_env(),
        cwd=REPO,
        timeout=240,
        check=True,
    )
    return dict(json.loads(ref.stdout))


@pytest.fixture(scope="module")
def nat_mesh(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[tuple[NatMesh, list[MeshNode]]]:
    reason = nat_unavailable_reason(need_tc=True)
    if reason:
        pytest.skip(reason)
    workdir: Path = tmp_path_factory.mktemp("nat")
    with open_nat_mesh(workdir, homes=3, symmetric={2}, rate="100mbit") as mesh:
        mesh.spawn = forked_spawn  # nodes forked into their hosts: no interpreter start-up
        public, home0, home1, home2 = mesh.bed.hosts
        first = mesh.start_node(public, "--no-serve").wait_up(240)
        homes = [mesh.start_node(h, *HOME_ARGS, bootstrap=first.addr) for h in (home0, home1)]
        symmetric = mesh.start_node(home2, "--no-serve", bootstrap=first.addr)
        nodes = [first, *(n.wait_up(300) for n in homes)]
        symmetric.wait_up(300)
        yield mesh, nodes


@pytest.fixture(autouse=True)
def _logs_of_a_failed_test(
    request: pytest.FixtureRequest, nat_mesh: tuple[NatMesh, list[MeshNode]]
) -> Iterator[None]:
    """Every node's log tail after a test that failed (the mesh outlives the test)."""
    yield
    print_logs_if_failed(request, nat_mesh[0].nodes)


def _symmetric_home(mesh: NatMesh) -> MeshNode:
    """The ``--no-serve`` node behind home 2's symmetric router (started last)."""
    return mesh.nodes[3]


def _reach_by_peer(view: dict[str, Any]) -> dict[str, str]:
    return {str(p["peer_id"]): reach_of(p.get("record") or {}) for p in view.get("peers", [])}


def test_members_learn_public_or_behind_nat(nat_mesh: tuple[NatMesh, list[MeshNode]]) -> None:
    mesh, _ = nat_mesh
    public_node, *home_nodes = mesh.nodes  # the symmetric home's node too
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
    assert all("no member of the mesh is publicly reachable" not in n.log() for n in mesh.nodes)


def _records(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(p["peer_id"]): dict(p.get("record") or {}) for p in view.get("peers", [])}


def test_homes_reach_each_other_through_the_public_relay(
    nat_mesh: tuple[NatMesh, list[MeshNode]],
) -> None:
    mesh, nodes = nat_mesh
    public_node, home0, home1 = nodes
    deadline = time.monotonic() + 150
    records: dict[str, dict[str, Any]] = {}
    wanted: dict[str, bool] = {}
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = mesh.status(mesh.bed.homes[0], home0)
        records = _records(view)
        health = {str(p["peer_id"]): p.get("health") for p in view.get("peers", [])}
        extra = {pid: r.get("extra") or {} for pid, r in records.items()}
        # the homes' connection runs through the relay (each announces whom it reaches
        # so), or ran through it and has moved onto a punched path already (a control
        # connection is punched only from a relayed one: hetmesh.nat.punch_control)
        relayed = (
            home1.peer_id in (extra.get(home0.peer_id, {}).get(RELAYED_KEY) or ())
            or home0.peer_id in (extra.get(home1.peer_id, {}).get(RELAYED_KEY) or ())
            or f"control connection to {home1.peer_id} moved" in home0.log()
            or f"control connection to {home0.peer_id} moved" in home1.log()
        )
        wanted = {
            "the public node relays": extra.get(public_node.peer_id, {}).get(RELAY_KEY) == 1,
            "home0 via it": extra.get(home0.peer_id, {}).get(VIA_KEY) == public_node.peer_id,
            "home1 via it": extra.get(home1.peer_id, {}).get(VIA_KEY) == public_node.peer_id,
            "home1 alive to home0": health.get(home1.peer_id) == "alive",
            "relayed": relayed,
        }
        if all(wanted.values()):
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"no relayed link between the homes: {wanted}, health {health}: {records}")
    # the public node relays, it does not need one
    assert not (records[public_node.peer_id].get("extra") or {}).get(VIA_KEY)


def test_homes_serve_the_default_model_through_the_relay_like_one_process(
    nat_mesh: tuple[NatMesh, list[MeshNode]], reference: dict[str, Any]
) -> None:
    mesh, nodes = nat_mesh
    _, home0, home1 = nodes

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
    # a failed request shows the homes' logs (the module fixture's own dump never sees a
    # test's failure)
    assert "error" not in lines[0], f"{lines[0]}\n{home0.log()[-4000:]}\n{home1.log()[-4000:]}"
    assert lines[0]["tokens"] == reference["tokens"][:NEW_TOKENS]
    # the homes met over the relayed connection and the data-plane link between them
    # was hole-punched through both (cone) routers: no direct endpoint of the other
    # home was dialled blindly, and no link stayed on the relayed stream
    logs = home0.log() + home1.log()
    # (over the relay, or over the control connection punched after it: either way the
    # data plane knew the other home's endpoints sit behind its router)
    assert "the control connection is relayed" in logs or (
        "the control connection is hole-punched" in logs
    )
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
    # (hetmesh.nat.link_probe), so the planner prices the path the tensors take
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


def _punch_line(asker: MeshNode, answerer: MeshNode, *, moved: bool) -> str:
    if moved:
        return f"control connection to {answerer.peer_id} moved onto a hole-punched path"
    return f"control connection to {answerer.peer_id} stays relayed"


def test_cone_homes_punch_their_control_connection_a_symmetric_home_stays_relayed(
    nat_mesh: tuple[NatMesh, list[MeshNode]],
) -> None:
    mesh, nodes = nat_mesh
    _, home0, home1 = nodes
    home2 = _symmetric_home(mesh)
    # the lower peer id of each pair asks; between the cone homes the punch succeeds
    low, high = sorted((home0, home1), key=lambda n: n.peer_id)
    wait_for(
        lambda: (
            _punch_line(low, high, moved=True) in low.log()
            and _punch_line(high, low, moved=True) in high.log()
        ),
        180,
        "the cone homes' control connection to move onto a punched path",
        every_s=2.0,
    )
    # every punch towards the symmetric home fails: its connections stay relayed
    for other in (home0, home1):
        asker, answerer = sorted((other, home2), key=lambda n: n.peer_id)
        wait_for(
            lambda a=asker, b=answerer: _punch_line(a, b, moved=False) in a.log(),
            180,
            f"a failed control punch between {asker.host} and {answerer.host}",
            every_s=2.0,
        )
        assert _punch_line(asker, answerer, moved=True) not in asker.log()

    # status: the symmetric home still reaches both homes through the relay, the cone
    # homes no longer announce each other as relayed
    def settled() -> dict[str, dict[str, Any]] | None:
        records = _records(mesh.status(mesh.bed.homes[0], home0))
        homes = (home0, home1, home2)
        if not {n.peer_id for n in homes} <= records.keys():
            return None
        relayed = {
            n.peer_id: set((records[n.peer_id].get("extra") or {}).get(RELAYED_KEY) or ())
            for n in homes
        }
        if relayed[home2.peer_id] != {home0.peer_id, home1.peer_id}:
            return None
        if home1.peer_id in relayed[home0.peer_id] or home0.peer_id in relayed[home1.peer_id]:
            return None
        return records

    records = wait_for(settled, 90, "status to show which homes stay relayed", every_s=2.0)
    for other in (home0, home1):
        kind = link_kind(
            other.peer_id, records[other.peer_id], home2.peer_id, records[home2.peer_id]
        )
        assert kind == "relayed"


_STREAM = """
import json, sys, trio
from hetmesh.client.mesh import Finished, TokenEvent, open_mesh_client
async def main():
    ids = [int(t) for t in sys.argv[3].split(",")]
    async with open_mesh_client(sys.argv[1], mesh_secret=sys.argv[2], timeout_s=120.0) as mesh:
        async for event in mesh.stream(prompt_ids=ids, max_new_tokens=int(sys.argv[4])):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                print(json.dumps({"token": event.token_id}), flush=True)
            elif isinstance(event, Finished):
                print(json.dumps({"finished": event.finish_reason}), flush=True)
trio.run(main)
"""


def _health(view: dict[str, Any]) -> dict[str, str]:
    return {str(p["peer_id"]): str(p.get("health")) for p in view.get("peers", [])}


def test_killing_the_relay_mid_generation_keeps_the_homes_serving(
    nat_mesh: tuple[NatMesh, list[MeshNode]], reference: dict[str, Any]
) -> None:
    """Destructive (kills the public node): keep it last in the module."""
    mesh, nodes = nat_mesh
    public_node, home0, home1 = nodes
    # the homes' control connection leaves the relay for a hole-punched path
    # (hetmesh.nat.punch_control), so the relay's death takes nothing with it
    for node in (home0, home1):
        wait_for(
            lambda node=node: "moved onto a hole-punched path" in node.log(),
            180,
            f"the control connection in {node.host} to move onto a punched path",
            every_s=2.0,
        )
    mesh.wait_serving(mesh.bed.homes[0], home0)
    argv = [
        sys.executable,
        "-c",
        _STREAM,
        home0.addr,
        mesh.secret,
        ",".join(str(t) for t in reference["prompt"]),
        str(LONG_TOKENS),
    ]
    client = subprocess.Popen(
        mesh.bed.argv(mesh.bed.homes[0], argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        cwd=REPO,
    )
    try:
        assert client.stdout is not None
        first = client.stdout.readline()  # blocks until the first token (or the client dies)
        if not first.startswith(b"{"):
            pytest.fail(f"no first token: {client.communicate(timeout=60)[1].decode()[-3000:]}")
        public_node.proc.kill()
        public_node.proc.wait(timeout=30)
        rest, err = client.communicate(timeout=300)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    events = [json.loads(x) for x in (first + rest).decode().splitlines() if x.startswith("{")]
    tokens = [e["token"] for e in events if "token" in e]
    # the relay died after the first token: the rest crossed the homes without it
    assert tokens == reference["tokens"], err.decode()[-3000:]
    assert events[-1].get("finished"), events[-1]

    # both homes learn the public node is dead, and still see each other alive
    def relay_dead() -> dict[str, str] | None:
        health = _health(mesh.status(mesh.bed.homes[0], home0))
        return health if health.get(public_node.peer_id) in ("dead", None) else None

    health = wait_for(relay_dead, 120, "home0 to declare the relay dead", every_s=2.0)
    assert health.get(home1.peer_id) == "alive", health
    # no silent failure: with no public member left, each home says what to do, and
    # status shows why a home is unreachable from outside (no relay any more)
    for node in (home0, home1):
        wait_for(
            lambda node=node: "no member of the mesh is publicly reachable" in node.log(),
            120,
            f"{node.host} to say it is behind NAT with no public member",
            every_s=2.0,
        )

    def no_relay() -> str | None:
        record = _records(mesh.status(mesh.bed.homes[0], home0)).get(home1.peer_id) or {}
        text = reach_text(record)
        return text if "no relay" in text else None

    assert "unreachable from outside its network" in wait_for(
        no_relay, 120, "status to show home1 without a relay", every_s=2.0
    )
    # and the mesh keeps serving the homes' requests with the relay gone
    again = mesh.generate(mesh.bed.homes[1], home1, reference["prompt"], NEW_TOKENS)
    assert again.get("tokens") == reference["tokens"][:NEW_TOKENS], again
    assert _health(mesh.status(mesh.bed.homes[1], home1)).get(home0.peer_id) == "alive"
