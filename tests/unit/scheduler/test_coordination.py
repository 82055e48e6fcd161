"""The plan loop's pure decision: one table of (view, state, config) -> (actions, state).

No trio, no libp2p, no clock: each row builds a view of a small mesh of CPU
devices and a toy model, and states what :func:`decide` must do with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from hetmesh.resources import DeviceProfile, LinkProfile
from hetmesh.scheduler import MeshSnapshot, PlanConstraints, evaluate, plan
from hetmesh.scheduler.coordination import (
    INHERITED_REASON,
    LOST_PEER_REASON,
    UNMEASURED_REASON,
    Adopt,
    CoordinatorConfig,
    CoordinatorState,
    Keep,
    MeshView,
    Publish,
    decide,
    surviving,
)
from hetmesh.scheduler.plan_trust import MAX_EPOCH
from hetmesh.scheduler.records import Plan, device_key
from tests.unit.scheduler.sched_helpers import cpu_device as device
from tests.unit.scheduler.sched_helpers import toy_cpu_model

GIB = 1024**3
MODEL = toy_cpu_model()
OTHER_MODEL = dataclasses.replace(MODEL, name="other")
LIMITS = PlanConstraints(max_context_tokens=128, reserve_bytes=0, reserve_fraction=0.0)
HETMESH = CoordinatorConfig(model=MODEL, standby=False)
HINT = "; try compact weights"


def mesh(*peers: str, memory: int = 4 * GIB) -> MeshSnapshot:
    devices = tuple(device(p, memory) for p in peers)
    links = tuple(
        LinkProfile(src=a, dst=b, rtt_s=1e-3, bandwidth_bps=1e9)
        for a in peers
        for b in peers
        if a != b
    )
    return MeshSnapshot(devices=devices, links=links)


def planned(snapshot: MeshSnapshot, epoch: int = 0, model: object = MODEL) -> Plan:
    return plan(snapshot.devices, snapshot.links, model, constraints=LIMITS, epoch=epoch)  # type: ignore[arg-type]


def whole_model_on(snapshot: MeshSnapshot, *peers: str, epoch: int = 3) -> Plan:
    """One single-stage pipeline per peer: replicas, so losing one leaves the others."""
    units = MODEL.num_units
    placed = [[(p, "cpu", 0, units)] for p in peers]
    found = evaluate(
        placed, snapshot.devices, snapshot.links, MODEL, constraints=LIMITS, epoch=epoch
    )
    assert found is not None
    return found


def split_on(snapshot: MeshSnapshot, first: str, second: str, *, epoch: int = 2) -> Plan:
    """One pipeline across two peers: losing either leaves nothing."""
    half = MODEL.num_units // 2
    placed = [[(first, "cpu", 0, half), (second, "cpu", half, MODEL.num_units)]]
    found = evaluate(
        placed, snapshot.devices, snapshot.links, MODEL, constraints=LIMITS, epoch=epoch
    )
    assert found is not None
    return found


def view(
    snapshot: MeshSnapshot,
    *,
    me: str = "a",
    plans: tuple[Plan, ...] = (),
    settled: bool = True,
    following: tuple[tuple[str, str], ...] = (),
) -> MeshView:
    peers = tuple(sorted({d.peer_id for d in snapshot.devices} - {me}))
    return MeshView(
        me=me,
        peers=peers,
        snapshot=snapshot,
        constraints=LIMITS,
        plans=plans,
        settled=settled,
        following=following,
    )


AB, ABC, A = mesh("a", "b"), mesh("a", "b", "c"), mesh("a")
PLAN_AB = planned(AB)
REPLICAS = whole_model_on(AB, "a", "b")
SPLIT = split_on(AB, "a", "b")


@dataclass(frozen=True)
class Row:
    """Inputs, and what must come out: the action kinds in order and the state's key fields."""

    name: str
    view: MeshView
    state: CoordinatorState
    actions: tuple[type, ...]
    config: CoordinatorConfig = HETMESH
    check: Callable[[tuple[object, ...], CoordinatorState], bool] = lambda _a, _s: True


def epoch_of(n: int) -> Callable[[tuple[object, ...], CoordinatorState], bool]:
    return lambda _a, s: s.plan is not None and s.plan.epoch == n


ROWS = [
    Row(
        "a follower with nothing announced keeps waiting",
        view(AB, me="b"),
        CoordinatorState(),
        (Keep,),
        check=lambda _a, s: s == CoordinatorState(),
    ),
    Row(
        "a follower adopts a peer's plan and will judge it afresh",
        view(AB, me="b", plans=(PLAN_AB,)),
        CoordinatorState(planned_on=AB),
        (Adopt,),
        check=lambda a, s: s.plan == PLAN_AB and s.planned_on is None and not a[0].made_here,  # type: ignore[attr-defined]
    ),
    Row(
        "a plan for another model is ignored",
        view(AB, me="b", plans=(planned(AB, 5, OTHER_MODEL),)),
        CoordinatorState(),
        (Keep,),
    ),
    Row(
        "an older epoch never replaces the followed plan",
        view(AB, me="b", plans=(PLAN_AB,)),
        CoordinatorState(plan=PLAN_AB.with_epoch(4)),
        (Keep,),
        check=epoch_of(4),
    ),
    Row(
        "the coordinator waits until the mesh settled",
        view(AB, settled=False),
        CoordinatorState(),
        (Keep,),
    ),
    Row(
        "a settled coordinator with no plan publishes epoch 0 and follows it",
        view(AB),
        CoordinatorState(),
        (Publish, Adopt),
        check=lambda a, s: epoch_of(0)(a, s) and a[1].made_here and s.planned_on == AB,  # type: ignore[attr-defined]
    ),
    Row(
        "no change since the plan was judged: keep it",
        view(AB),
        CoordinatorState(plan=PLAN_AB, published=PLAN_AB, planned_on=AB, signer="a"),
        (Keep,),
        check=lambda _a, s: s.plan is PLAN_AB,
    ),
    Row(
        "a plan adopted from elsewhere is judged on the coordinator's own inputs",
        view(AB),
        CoordinatorState(plan=PLAN_AB, signer="a"),
        (Keep,),
        check=lambda _a, s: s.plan is PLAN_AB and s.planned_on == AB,
    ),
    Row(
        "every pipeline lost a peer: plan afresh at the next epoch",
        view(A),
        CoordinatorState(plan=SPLIT, planned_on=AB),
        (Publish, Adopt),
        check=lambda _a, s: (
            epoch_of(3)(_a, s)
            and {st.peer_id for p in s.plan.pipelines for st in p.stages} == {"a"}
        ),  # type: ignore[union-attr]
    ),
    Row(
        "a replica lost its peer: the survivors serve on",
        view(A),
        CoordinatorState(plan=REPLICAS, planned_on=AB),
        (Publish, Adopt),
        check=lambda a, s: (
            a[0].reason == LOST_PEER_REASON and epoch_of(4)(a, s) and len(s.plan.pipelines) == 1
        ),  # type: ignore[attr-defined, union-attr]
    ),
    Row(
        "the mesh cannot hold the model: say why (with the hint), publish nothing",
        view(mesh("a", "b", memory=GIB // 1024)),
        CoordinatorState(),
        (Keep,),
        config=dataclasses.replace(HETMESH, compact_hint=HINT),
        check=lambda _a, s: s.plan is None and s.insufficient.endswith(HINT),
    ),
    Row(
        "no hint when every device already holds a compact format",
        view(mesh("a", memory=GIB // 1024)),
        CoordinatorState(),
        (Keep,),
        config=dataclasses.replace(
            HETMESH, compact_hint=HINT, compact_formats=frozenset({"float32"})
        ),
        check=lambda _a, s: bool(s.insufficient) and not s.insufficient.endswith(HINT),
    ),
    Row(
        "a verdict clears once the model fits",
        view(AB),
        CoordinatorState(insufficient="too small"),
        (Publish, Adopt),
        check=lambda _a, s: s.insufficient == "",
    ),
    Row(
        "a forced baseline keeps its placement while membership holds",
        view(AB),
        CoordinatorState(plan=PLAN_AB, planned_on=mesh("a", "b", memory=8 * GIB), signer="a"),
        (Keep,),
        config=dataclasses.replace(HETMESH, strategy="even"),
    ),
    Row(
        "a forced baseline places again when a peer joins",
        view(ABC),
        CoordinatorState(plan=PLAN_AB, published=PLAN_AB, planned_on=AB, signer="a"),
        (Publish, Adopt),
        config=dataclasses.replace(HETMESH, strategy="even"),
        check=lambda a, s: (
            a[0].reason == "forced even placement"
            and epoch_of(1)(a, s)
            and s.plan.strategy == "even"
        ),  # type: ignore[attr-defined, union-attr]
    ),
    Row(
        "a new coordinator signs the plan it inherits, one epoch up",
        view(AB),
        CoordinatorState(plan=PLAN_AB.with_epoch(7), planned_on=AB, signer="z"),
        (Publish, Adopt),
        check=lambda a, s: (
            a[0].reason == INHERITED_REASON and epoch_of(8)(a, s) and s.signer == "a"
        ),  # type: ignore[attr-defined]
    ),
    Row(
        "a coordinator again after another's term inherits what it follows, not its old plan",
        view(AB),
        CoordinatorState(
            plan=PLAN_AB.with_epoch(7), published=SPLIT.with_epoch(6), planned_on=AB, signer="z"
        ),
        (Publish, Adopt),
        check=lambda a, s: (
            a[0].reason == INHERITED_REASON
            and epoch_of(8)(a, s)
            and s.plan.pipelines == PLAN_AB.pipelines
        ),  # type: ignore[attr-defined, union-attr]
    ),
    Row(
        "a follower whose plan another peer signed takes the coordinator's, lower epoch or not",
        # b planned alone before it heard of a, which follows its own plan: one vote each,
        # the lower id wins the tie and the two halves merge on a's plan
        view(AB, me="b", plans=(PLAN_AB,), following=(("a", "a"),)),
        CoordinatorState(plan=SPLIT.with_epoch(9), published=SPLIT.with_epoch(9), signer="b"),
        (Adopt,),
        check=lambda _a, s: s.plan == PLAN_AB and s.signer == "a",
    ),
    Row(
        "a coordinator publishes no plan that rests on one member's unmeasured claims",
        # b measured its block step, a (which can hold it all) only claims its speed
        dataclasses.replace(
            view(AB),
            constraints=dataclasses.replace(
                LIMITS, block_step_s_by_device={device_key("b", "cpu"): 10.0}
            ),
        ),
        CoordinatorState(),
        (Keep,),
        check=lambda _a, s: s.plan is None and s.insufficient.startswith(UNMEASURED_REASON),
    ),
    Row(
        "a coordinator never publishes past the epoch limit",
        view(A),
        CoordinatorState(plan=SPLIT.with_epoch(MAX_EPOCH), planned_on=AB, signer="a"),
        (Keep,),
        check=epoch_of(MAX_EPOCH),
    ),
    Row(
        "a coordinator's first plan is numbered above every epoch announced",
        dataclasses.replace(view(AB), epoch_floor=41),
        CoordinatorState(),
        (Publish, Adopt),
        check=epoch_of(42),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decide_table(row: Row) -> None:
    step = decide(row.view, row.state, row.config)
    assert tuple(type(a) for a in step.actions) == row.actions
    assert row.check(step.actions, step.state)
    for action in step.actions:  # what is published is what is then followed
        if isinstance(action, Publish):
            assert step.state.published == action.plan
    assert decide(row.view, row.state, row.config) == step  # no hidden state: same in, same out


def test_decide_equal_epochs_end_on_one_plan_everywhere() -> None:
    # two nodes that both believed they coordinated publish the same epoch: each
    # ends on the same one of the two, whichever it made itself
    ours, theirs = planned(AB), whole_model_on(AB, "a", "b", epoch=0)
    assert ours != theirs
    chosen = []
    for mine, other in ((ours, theirs), (theirs, ours)):
        state = CoordinatorState(plan=mine, published=mine, planned_on=AB)
        step = decide(view(AB, me="b", plans=(other,)), state, HETMESH)
        chosen.append(step.state.plan)
    assert chosen[0] == chosen[1]


def test_surviving_drops_only_pipelines_that_lost_a_peer() -> None:
    assert surviving(None, AB, MODEL, LIMITS) is None
    assert surviving(REPLICAS, AB, MODEL, LIMITS) is REPLICAS
    left = surviving(REPLICAS, A, MODEL, LIMITS)
    assert left is not None
    assert [p.peers for p in left.pipelines] == [frozenset({"a"})]
    assert left.epoch == REPLICAS.epoch
    assert surviving(PLAN_AB, mesh("c"), MODEL, LIMITS) is None


def test_a_held_drift_publishes_nothing_and_is_judged_again_when_the_hold_ends() -> None:
    """While drift may not move the plan, the coordinator keeps the inputs the plan stands
    on, so the same drift is judged (and may move it) once the hold ends."""
    current = planned(AB)
    faster = MeshSnapshot(
        devices=tuple(
            DeviceProfile.from_wire(
                {**d.to_wire(), "memory_bandwidth_bps": d.memory_bandwidth_bps * 4}
            )
            if d.peer_id == "b"
            else d
            for d in AB.devices
        ),
        links=AB.links,
    )
    state = CoordinatorState(plan=current, published=current, planned_on=AB, signer="a")
    held_view = dataclasses.replace(view(faster), drift_allowed=False)
    held = decide(held_view, state, HETMESH)
    assert not any(isinstance(a, Publish) for a in held.actions)
    assert held.state.planned_on is AB  # the drift is not forgotten
    free = decide(view(faster), held.state, HETMESH)
    published = [a for a in free.actions if isinstance(a, Publish)]
    assert published, free.actions
    assert published[0].drift
    assert "drift" in published[0].reason
