"""The plan loop's decision, as one pure function: :func:`decide`.

Every node runs the same loop (``hetmesh.node.serving``): gather a
:class:`MeshView`, call :func:`decide` with the :class:`CoordinatorState` it
keeps, carry out the returned :class:`Step`'s actions, keep its state. The
rules, in the order :func:`decide` applies them:

1. **Adopt**: follow the newest plan seen for this model (our own last
   publication included while we coordinate) if it supersedes the one followed
   (:func:`~hetmesh.scheduler.replan.supersedes`), or whatever its rank if the
   followed one was signed by a peer that no longer coordinates. The view's
   plans are only those the coordinator signed
   (:func:`~hetmesh.scheduler.plan_trust.plan_refusal`, in the node's glue). A
   plan made elsewhere is judged afresh the next time we coordinate.
2. **Coordinate** (only the peer :func:`choose_coordinator` names, once settled):
   drop the pipelines that lost a peer (:func:`surviving`), then ask the
   strategy for a better plan — the replanning policy
   (:func:`~hetmesh.scheduler.replan.replan`, with standby replicas if
   configured) or a forced baseline placement (on membership change only).
   No better plan, but pipelines were dropped: publish the survivors. Still
   nothing, but the plan followed was signed by a former coordinator: publish
   it again, one epoch up, to sign it. Still nothing, but a spare device
   joined: publish the plan with a standby replica added. A plan that puts
   most of the model on one member's unmeasured claims is never published
   (followers refuse it:
   :func:`~hetmesh.scheduler.plan_trust.unmeasured_majority`). A mesh that cannot
   hold the model records why
   (``CoordinatorState.insufficient``) and publishes nothing.
3. **Adopt** again, so the coordinator follows what it just published unless
   a peer's plan outranks it.

Who coordinates (:func:`choose_coordinator`) is a matter of standing in the
mesh, never of a peer id alone, so a newcomer cannot win it by grinding keys:
the coordinator whose signed plan a node follows stays while it lives, unless
more live members announce following another live signer (two halves that
planned apart merge); a node that follows nothing takes the signer most live
members follow; when the signer is gone, its successor is drawn among the
live peers its plan placed, by a hash salted with that plan (their ids were
fixed before the salt existed). Only a mesh where nobody follows a plan yet
falls back to the lowest live id.

No clocks, no I/O, no randomness: the same view and state give the same step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, ModelProfile, PeerId
from hetmesh.scheduler.baselines import BASELINES
from hetmesh.scheduler.plan_trust import (
    MAX_EPOCH,
    MAX_FLOOR,
    plan_message,
    unmeasured_majority,
)
from hetmesh.scheduler.planner import evaluate
from hetmesh.scheduler.records import Objective, Plan, PlanConstraints
from hetmesh.scheduler.replan import (
    MeshSnapshot,
    ReplanOutcome,
    coordinator,
    newest,
    replan,
    supersedes,
)
from hetmesh.scheduler.standby import add_standby_replicas, with_standby

HETMESH_STRATEGY = "hetmesh"
LOST_PEER_REASON = "pipelines with a lost peer dropped; the rest serve on"
STANDBY_REASON = "a spare device becomes a standby replica"
INHERITED_REASON = "a new coordinator signs the plan it inherits"
NEW_TERM_REASON = "a term above the one other members follow"
UNMEASURED_REASON = "no plan the members would follow yet"


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """What a node plans for and how; fixed for the node's life."""

    model: ModelProfile
    strategy: str = HETMESH_STRATEGY  # or a key of ``baselines.BASELINES``
    objective: Objective = "latency"
    standby: bool = False
    # weight formats that already hold a fraction of float32's bytes: a mesh whose
    # every device serves one of them gets no "try compact weights" hint
    compact_formats: frozenset[str] = frozenset()
    compact_hint: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshView:
    """One moment of the mesh as this node sees it."""

    me: PeerId
    snapshot: MeshSnapshot  # devices (at full capacity) and links, ours included
    constraints: PlanConstraints  # calibration and weight formats filled in
    peers: tuple[PeerId, ...] = ()  # live peers serving the same model
    # the plans those peers announce they follow that passed
    # :func:`~hetmesh.scheduler.plan_trust.plan_refusal`: signed by the coordinator
    plans: tuple[Plan, ...] = ()
    settled: bool = True  # past the start-up wait: enough peers heard of to plan
    drift_allowed: bool = True  # drift alone may move the plan now (replan.DriftHold)
    epoch_floor: int = -1  # the highest epoch announced (plan_trust.epoch_floor)
    term_floor: int = -1  # the highest term announced (plan_trust.term_floor)
    # (member, signer of the plan it announces following) for each peer that announces
    # one: who the mesh follows (choose_coordinator)
    following: tuple[tuple[PeerId, PeerId], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorState:
    """What the loop carries from one step to the next."""

    plan: Plan | None = None  # the plan this node follows
    published: Plan | None = None  # the last plan this node made as coordinator
    planned_on: MeshSnapshot | None = None  # the inputs the followed plan was judged on
    insufficient: str = ""  # why the mesh cannot hold the model ("" when it can)
    signer: PeerId | None = None  # the coordinator that signed the followed plan


@dataclass(frozen=True, slots=True)
class Keep:
    """Nothing to change."""


@dataclass(frozen=True, slots=True)
class Adopt:
    """Follow ``plan``: load the stages it assigns here, retire the others, announce it."""

    plan: Plan
    made_here: bool


@dataclass(frozen=True, slots=True)
class Publish:
    """This node, coordinating, made ``plan`` (an :class:`Adopt` of it follows if it wins)."""

    plan: Plan
    reason: str
    drift: bool = False  # made on drifted measurements alone (replan.DriftHold)


Action = Keep | Adopt | Publish


@dataclass(frozen=True, slots=True)
class Step:
    """What :func:`decide` returns: the actions in order, and the state to keep."""

    actions: tuple[Action, ...]
    state: CoordinatorState


def decide(view: MeshView, state: CoordinatorState, config: CoordinatorConfig) -> Step:
    """One turn of the plan loop (see the module docstring for the rules).

    Raises :class:`~hetmesh.errors.InsufficientCapacity` only if re-scoring the
    surviving pipelines or adding a standby replica finds they no longer fit;
    the strategy's own verdict is recorded in ``state.insufficient`` instead.
    """
    actions: list[Action] = []
    boss = choose_coordinator(
        (view.me, *view.peers),
        me=view.me,
        plan=state.plan,
        signer=state.signer,
        following=dict(view.following),
    )
    state = _adopt(view, state, config, actions, boss)
    if boss == view.me and view.settled:
        state = _coordinate(view, state, config, actions)
        state = _adopt(view, state, config, actions, boss)
    return Step(tuple(actions) or (Keep(),), state)


def choose_coordinator(
    live: Iterable[PeerId],
    *,
    me: PeerId,
    plan: Plan | None,
    signer: PeerId | None,
    following: Mapping[PeerId, PeerId],
) -> PeerId | None:
    """The peer that plans, as ``me`` sees the mesh (every node that follows the same
    plan and sees the same members names the same one).

    ``live``: the live peers serving the model, ``me`` among them; ``plan`` and
    ``signer``: the plan ``me`` follows and the coordinator that signed it;
    ``following``: each member's announced signer (``me``'s own is ``signer``).

    1. Each live member has one vote, the live signer it follows. The signer
       ``me`` follows stays coordinator while it lives, unless another live
       signer has more votes (ties: the lower id), so two halves of a mesh that
       planned apart end on one coordinator.
    2. ``me``'s signer is gone: its successor is the live peer placed in ``plan``
       with the lowest ``sha256(plan || peer id)``: those ids were fixed before
       the plan (the salt) existed, so none could be ground for it.
    3. ``me`` follows nothing: the live signer with the most votes (ties: the
       lower id).
    4. Nobody follows a plan yet (a mesh starting): the lowest live id.

    A member can only win by votes, one per member: it needs as many members as
    follow the coordinator, not a low peer id.
    """
    alive = set(live) | {me}
    votes = Counter(
        s for member, s in following.items() if member in alive and s in alive and member != me
    )
    if signer is not None and signer in alive:
        votes[signer] += 1
        best = min(votes, key=lambda p: (-votes[p], p))
        return signer if votes[best] == votes[signer] and best >= signer else best
    if signer is not None and plan is not None:
        salt = hashlib.sha256(plan_message(plan)).digest()
        placed = {s.peer_id for p in plan.pipelines for s in p.stages} & alive
        if placed:
            return min(placed, key=lambda p: (hashlib.sha256(salt + p.encode()).digest(), p))
    if votes:
        return min(votes, key=lambda p: (-votes[p], p))
    return coordinator(alive)


def _adopt(
    view: MeshView,
    state: CoordinatorState,
    config: CoordinatorConfig,
    actions: list[Action],
    boss: PeerId | None,
) -> CoordinatorState:
    # our own publication first: of two plans of the same rank the first seen wins;
    # it counts only while we coordinate (view.plans are all signed by the coordinator),
    # and not when it is older than a plan another coordinator signed since: made in an
    # earlier term of ours, it would take the mesh's epochs back (what we follow is
    # inherited instead, one epoch up: _coordinate)
    published = state.published if boss == view.me else None
    if (
        published is not None
        and state.plan is not None
        and state.signer not in (None, view.me)
        and (published.epoch <= state.plan.epoch or published.term < state.plan.term)
    ):
        published = None
    mine = [published] if published is not None else []
    best = newest(p for p in mine + list(view.plans) if p.model_name == config.model.name)
    if best is None:
        return state
    # a plan signed by a peer that no longer coordinates gives way to the coordinator's,
    # whatever their epochs (two nodes may both have believed they coordinated)
    if not supersedes(best, state.plan) and state.signer in (None, boss):
        return state
    if best is state.plan:
        return state
    made_here = best is state.published
    actions.append(Adopt(best, made_here))
    # a plan made elsewhere was judged on inputs we do not know: judge it afresh
    planned_on = state.planned_on if made_here else None
    return dataclasses.replace(state, plan=best, planned_on=planned_on, signer=boss)


def _coordinate(
    view: MeshView, state: CoordinatorState, config: CoordinatorConfig, actions: list[Action]
) -> CoordinatorState:
    snapshot, constraints, model = view.snapshot, view.constraints, config.model
    if not snapshot.devices:
        return state
    current = surviving(state.plan, snapshot, model, constraints)
    # a first plan is numbered above every epoch announced, so epochs keep rising
    # (a floor past MAX_FLOOR, whoever computed it, would leave us no epochs: ignored)
    floor = view.epoch_floor if view.epoch_floor <= MAX_FLOOR else -1
    epoch = (state.plan.epoch + 1) if state.plan is not None else floor + 1
    term, new_term = _term(view, state)
    try:
        outcome = _candidate(
            current, state.planned_on, snapshot, constraints, config, view.drift_allowed
        )
    except InsufficientCapacity as exc:
        verdict = str(exc) + compact_hint(constraints, snapshot.devices, config)
        return dataclasses.replace(state, insufficient=verdict, planned_on=snapshot)
    candidate, reason = outcome.plan, outcome.reason
    # a drift held is judged again on the inputs the plan stands on, once the hold ends
    planned_on = state.planned_on if outcome.held else snapshot
    state = dataclasses.replace(state, insufficient="", planned_on=planned_on)
    if candidate is None and current is not None and current != state.plan:
        candidate, reason = current, LOST_PEER_REASON
    if candidate is None and current is not None and state.signer != view.me:
        candidate, reason = current, INHERITED_REASON
    if candidate is None and current is not None and new_term:
        candidate, reason = current, NEW_TERM_REASON
    if candidate is None and current is not None and config.standby:
        backed = add_standby_replicas(
            current, snapshot.devices, snapshot.links, model, constraints=constraints
        )
        if len(backed.pipelines) > len(current.pipelines):
            candidate, reason = backed, STANDBY_REASON
    if candidate is None:
        return state
    plan = candidate.with_epoch(max(epoch, candidate.epoch)).with_term(term)
    if plan.epoch > MAX_EPOCH:  # followers would refuse it (only an inflated floor gets here)
        return state
    why = unmeasured_majority(plan, model=model, constraints=constraints)
    if why:  # followers would refuse it too: wait for the measurements instead
        return dataclasses.replace(state, insufficient=f"{UNMEASURED_REASON}: {why}")
    drift = outcome.drift and candidate is outcome.plan
    actions.append(Publish(plan, reason, drift=drift))
    return dataclasses.replace(state, published=plan)


def _term(view: MeshView, state: CoordinatorState) -> tuple[int, bool]:
    """The term this coordinator signs its next plan in, and whether it is a new one.

    Its own term while it follows its own plan and no member follows a later
    term; else one above every term announced (a floor past ``MAX_FLOOR`` is
    ignored, as for epochs): followers refuse a plan of a term before theirs.
    """
    floor = view.term_floor if view.term_floor <= MAX_FLOOR else -1
    if state.plan is not None and state.signer == view.me and floor <= state.plan.term:
        return state.plan.term, False
    held = state.plan.term if state.plan is not None else -1
    return max(held, floor) + 1, True


def _candidate(
    current: Plan | None,
    planned_on: MeshSnapshot | None,
    snapshot: MeshSnapshot,
    constraints: PlanConstraints,
    config: CoordinatorConfig,
    drift_allowed: bool = True,
) -> ReplanOutcome:
    """The strategy's new plan (``plan`` None: keep ``current``) and why."""
    model = config.model
    if config.strategy == HETMESH_STRATEGY:
        outcome = replan(
            current,
            planned_on,
            snapshot,
            model,
            objective=config.objective,
            constraints=constraints,
            drift_allowed=drift_allowed,
        )
        candidate = outcome.plan
        if candidate is not None and config.standby:
            candidate = with_standby(
                candidate,
                snapshot.devices,
                snapshot.links,
                model,
                constraints=constraints,
                previous=current,
            )
        return dataclasses.replace(outcome, plan=candidate)
    # a forced baseline ignores drift: it places again only when membership changes
    peers = {d.peer_id for d in snapshot.devices}
    changed = planned_on is None or peers != {d.peer_id for d in planned_on.devices}
    reason = f"forced {config.strategy} placement"
    if not (changed or current is None):
        return ReplanOutcome(None, reason)
    placed = BASELINES[config.strategy](
        snapshot.devices,
        snapshot.links,
        model,
        objective=config.objective,
        constraints=constraints,
    )
    return ReplanOutcome(placed, reason)


def surviving(
    plan: Plan | None,
    snapshot: MeshSnapshot,
    model: ModelProfile,
    constraints: PlanConstraints,
) -> Plan | None:
    """``plan`` without the pipelines that lost a peer, re-scored; None if none is left.

    A standby replica that survives keeps serving: the coordinator then only
    replans if a new placement beats it by the adoption threshold, instead of
    reshuffling every stage after each loss.
    """
    if plan is None:
        return None
    alive = {d.peer_id for d in snapshot.devices}
    survivors = [p for p in plan.pipelines if p.peers <= alive]
    if not survivors:
        return None  # every pipeline lost a peer: plan afresh
    if len(survivors) == len(plan.pipelines):
        return plan
    placed = [[(s.peer_id, s.device, s.start, s.end) for s in p.stages] for p in survivors]
    return evaluate(
        placed,
        snapshot.devices,
        snapshot.links,
        model,
        objective=plan.objective,
        constraints=constraints,
        strategy=plan.strategy,
        epoch=plan.epoch,
    )


def compact_hint(
    constraints: PlanConstraints, devices: Sequence[DeviceProfile], config: CoordinatorConfig
) -> str:
    """``config.compact_hint`` unless every device already serves a compact format."""
    formats = {
        held.weights if (held := constraints.weights_for(d.peer_id, d.device)) else "float32"
        for d in devices
    }
    if formats <= config.compact_formats:
        return ""
    return config.compact_hint


__all__ = [
    "Action",
    "Adopt",
    "CoordinatorConfig",
    "CoordinatorState",
    "Keep",
    "MeshView",
    "Publish",
    "Step",
    "choose_coordinator",
    "compact_hint",
    "decide",
    "surviving",
]
