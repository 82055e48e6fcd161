"""The replanning policy: when to plan again, when to adopt, who plans, which plan wins.

Pure decisions for the coordinator service (the async glue lives with the node):

- :func:`should_replan`: membership changed, or a measured profile drifted by more
  than ``drift`` (20% by default) since the inputs of the current plan; a link whose
  two ends share a host (:attr:`MeshSnapshot.hosts`) is loopback, and its drift is the
  host's CPU, not a wire: it moves no plan;
- :class:`DriftHold`: how long a plan stands before drift alone may move it (a move
  reloads stages: minutes on a big model, and a busy machine's measurements swing);
- :func:`should_adopt`: a new plan is adopted only if its predicted gain over the
  current plan, *re-scored under the same fresh measurements*, passes
  ``min_gain`` (no flapping), or if the current plan no longer fits or names
  a departed device;
- :func:`coordinator`: the live peer with the lowest peer id;
- :func:`newest`: peers follow the plan of the highest rank they have seen
  (epoch first; equal epochs, which two nodes that both believed they
  coordinated can publish, are ordered the same way everywhere);
  :func:`supersedes` and :func:`newest_in_view` apply that order;
- :func:`replan`: all of the above in one call for the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetmesh.errors import InsufficientCapacity
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile, PeerId, WireRecord
from hetmesh.scheduler.heuristic import SearchOptions
from hetmesh.scheduler.planner import evaluate, placement, plan
from hetmesh.scheduler.records import Objective, Plan, PlanConstraints, device_key

DEFAULT_DRIFT = 0.2
DEFAULT_MIN_GAIN = 0.1
DRIFT_HOLD_MIN_S = 60.0  # the least a plan serves, ready, before drift alone may move it
DRIFT_HOLD_MAX_S = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSnapshot(WireRecord):
    """The planner's inputs at one moment."""

    devices: tuple[DeviceProfile, ...] = ()
    links: tuple[LinkProfile, ...] = ()
    # (peer, host identity) as each peer announced it: two peers of one identity share a
    # machine and a network namespace (hetmesh.transport.dataplane.host_identity), so
    # their link is loopback; a peer that announced none shares a host with nobody
    hosts: tuple[tuple[PeerId, str], ...] = ()

    def colocated(self, src: PeerId, dst: PeerId) -> bool:
        """Whether ``src`` and ``dst`` announced the same host: a link between them is
        loopback, its RTT a wait for the CPU."""
        hosts = dict(self.hosts)
        mine = hosts.get(src, "")
        return bool(mine) and mine == hosts.get(dst, "")

    def loopback_links(self) -> frozenset[tuple[PeerId, PeerId]]:
        """``(src, dst)`` of every link whose ends are :meth:`colocated`, in one pass."""
        hosts = {peer: host for peer, host in self.hosts if host}
        return frozenset(
            (link.src, link.dst)
            for link in self.links
            if (host := hosts.get(link.src)) is not None and host == hosts.get(link.dst)
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether to act, and why (for the log and ``hetmesh status``)."""

    act: bool
    reason: str
    drift: bool = False  # acting on drifted measurements alone (no membership change)


@dataclass(frozen=True, slots=True)
class ReplanOutcome:
    """What :func:`replan` decided: ``plan`` is the plan to publish, or ``None``."""

    plan: Plan | None
    reason: str
    candidate: Plan | None = field(default=None)
    drift: bool = False  # planned again on drift alone (see ``DriftHold``)
    held: bool = False  # drift seen, but the plan stands for now: judge it again later


def _drifted(old: float, new: float, drift: float) -> bool:
    scale = max(abs(old), abs(new))
    return scale > 0 and abs(new - old) / scale > drift


def should_replan(
    previous: MeshSnapshot | None, current: MeshSnapshot, *, drift: float = DEFAULT_DRIFT
) -> Verdict:
    """Whether the mesh changed enough since ``previous`` to plan again."""
    if previous is None:
        return Verdict(True, "no plan yet, or one made without our inputs")
    old = {device_key(d.peer_id, d.device): d for d in previous.devices}
    new = {device_key(d.peer_id, d.device): d for d in current.devices}
    joined, left = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    if joined or left:
        parts = ([f"joined {', '.join(joined)}"] if joined else []) + (
            [f"left {', '.join(left)}"] if left else []
        )
        return Verdict(True, "membership: " + "; ".join(parts))
    for key in sorted(new):
        a, b = old[key], new[key]
        for name in ("matmul_flops", "memory_bandwidth_bps", "memory_free_bytes"):
            if _drifted(float(getattr(a, name)), float(getattr(b, name)), drift):
                return Verdict(
                    True,
                    f"drift: {key} {name} {getattr(a, name)} -> {getattr(b, name)}",
                    drift=True,
                )
    old_links = {(x.src, x.dst): x for x in previous.links}
    loopback = current.loopback_links()
    for link in sorted(current.links, key=lambda x: (x.src, x.dst)):
        before = old_links.get((link.src, link.dst))
        if before is None:
            return Verdict(True, f"new link {link.src} -> {link.dst}")
        if (link.src, link.dst) in loopback:
            # loopback: a probe's round trip and copy rate between two processes of one
            # host are how soon the CPU ran them (under load: several times the quiet
            # figure, and back), which the devices' own figures already say
            continue
        if _drifted(before.bandwidth_bps, link.bandwidth_bps, drift):
            return Verdict(True, f"drift: link {link.src} -> {link.dst} bandwidth", drift=True)
        # RTTs of a few microseconds jitter by more than 20%; count 100 µs and up
        if abs(link.rtt_s - before.rtt_s) > 1e-4 and _drifted(before.rtt_s, link.rtt_s, drift):
            return Verdict(True, f"drift: link {link.src} -> {link.dst} rtt", drift=True)
    return Verdict(False, "no membership change or drift")


def gain(current: Plan, candidate: Plan) -> float:
    """The candidate's relative improvement over ``current`` (same objective)."""
    if candidate.objective == "latency":
        return current.objective_value / candidate.objective_value - 1.0
    if current.objective_value <= 0:
        return float("inf")
    return candidate.objective_value / current.objective_value - 1.0


def should_adopt(
    current: Plan | None, candidate: Plan, *, min_gain: float = DEFAULT_MIN_GAIN
) -> Verdict:
    """Adopt ``candidate`` over ``current`` (both scored on the same measurements)?"""
    if current is None:
        return Verdict(True, "the current plan no longer fits or there is none")
    if current.objective != candidate.objective:
        return Verdict(True, f"objective changed to {candidate.objective}")
    g = gain(current, candidate)
    if g > min_gain:
        return Verdict(True, f"predicted gain {g:.1%} > {min_gain:.0%}")
    return Verdict(False, f"predicted gain {g:.1%} ≤ {min_gain:.0%}")


@dataclass(slots=True)
class DriftHold:
    """How long the followed plan stands before drift alone may move it.

    A move reloads stages (minutes for a big model; a float32 stage on a loaded
    machine took five), and the moved pipeline serves nothing meanwhile. The figures
    that drift are a busy machine's, and a member's measured step rises with what it
    serves: a plan moved off the member that looked slow makes the next one look slow
    (a float32 cut under load swapped two hosts every six minutes, serving nothing
    between). So drift may move a plan only once it has served, ready, for
    ``max(min_s, 2 × the time it took to become ready)``, doubled for each move in a
    row that drift alone made, at most ``max_s``; a plan that never becomes ready may
    move after ``max_s``. Membership changes and plans that no longer fit never ask.
    Times are the caller's clock (no clocks here).
    """

    min_s: float = DRIFT_HOLD_MIN_S
    max_s: float = DRIFT_HOLD_MAX_S
    adopted_at: float | None = None  # when the followed plan was adopted
    ready_at: float | None = None  # when it first served (a pipeline fully ready)
    streak: int = 0  # moves in a row that drift alone made

    def adopted(self, now: float, *, drift: bool) -> None:
        """A new plan is followed from ``now``; ``drift``: drift alone made it."""
        self.adopted_at, self.ready_at = now, None
        self.streak = min(self.streak + 1, 16) if drift else 0

    def observe(self, now: float, *, ready: bool) -> None:
        """Whether the followed plan serves at ``now`` (its first ready time is kept)."""
        if ready and self.ready_at is None and self.adopted_at is not None:
            self.ready_at = now

    def hold_s(self) -> float:
        """How long the plan stands once ready."""
        load = (
            0.0
            if self.ready_at is None or self.adopted_at is None
            else (self.ready_at - self.adopted_at)
        )
        return min(self.max_s, max(self.min_s, 2.0 * load) * 2.0**self.streak)

    def allows(self, now: float) -> bool:
        """Whether drift alone may move the plan at ``now``."""
        if self.adopted_at is None:
            return True
        if self.ready_at is None:
            return now - self.adopted_at >= self.max_s
        return now - self.ready_at >= self.hold_s()


def coordinator(live_peers: Iterable[PeerId]) -> PeerId | None:
    """The live peer that plans: the lowest peer id, or ``None`` for an empty mesh."""
    return min(live_peers, default=None)


def newest(plans: Iterable[Plan]) -> Plan | None:
    """The plan to follow among those seen: highest epoch (ties: the same choice everywhere)."""
    best: Plan | None = None
    for p in plans:
        if best is None or _rank(p) > _rank(best):
            best = p
    return best


def supersedes(candidate: Plan, current: Plan | None) -> bool:
    """Whether a node following ``current`` switches to ``candidate``.

    The same order as :func:`newest`, so every node ends on the same plan even
    when two plans share an epoch: comparing epochs alone would leave each
    node on whichever of them it saw first.
    """
    return current is None or _rank(candidate) > _rank(current)


def announced_plans(extras: Iterable[Mapping[str, Any] | None]) -> list[Plan]:
    """The plans in announcements' ``extra["plan"]``, in order; malformed ones skipped.

    Through :func:`~hetmesh.scheduler.announcement.read_serving`, like every reader
    of what peers announce (which may be anything).
    """
    from hetmesh.scheduler.announcement import read_serving

    plans = (read_serving(extra).plan for extra in extras)
    return [p for p in plans if p is not None]


def newest_in_view(view: Mapping[str, Any]) -> Plan | None:
    """The newest plan the peers of a status view follow (``extra["plan"]``); None if none."""
    peers = view.get("peers") or ()
    return newest(announced_plans((p.get("record") or {}).get("extra") for p in peers))


def _rank(p: Plan) -> tuple[int, tuple[str, ...]]:
    return (p.epoch, tuple(x.key for x in p.pipelines))


def replan(
    current: Plan | None,
    previous: MeshSnapshot | None,
    now: MeshSnapshot,
    model: ModelProfile,
    *,
    objective: Objective = "latency",
    constraints: PlanConstraints | None = None,
    options: SearchOptions | None = None,
    drift: float = DEFAULT_DRIFT,
    min_gain: float = DEFAULT_MIN_GAIN,
    drift_allowed: bool = True,
) -> ReplanOutcome:
    """The coordinator's decision: a plan of epoch ``current.epoch + 1`` to publish, or none.

    ``drift_allowed``: whether drift alone may move the plan now (:class:`DriftHold`);
    when it may not, a drift is left ``held`` for a later turn.

    Raises :class:`~hetmesh.errors.InsufficientCapacity` if the mesh can no longer
    hold the model at all.
    """
    decision = should_replan(previous if current is not None else None, now, drift=drift)
    if not decision.act:
        return ReplanOutcome(None, decision.reason)
    if decision.drift and not drift_allowed:
        return ReplanOutcome(None, f"{decision.reason}; held while the plan settles", held=True)
    cons = constraints or (current.constraints if current is not None else PlanConstraints())
    epoch = current.epoch + 1 if current is not None else 0
    candidate = plan(
        now.devices,
        now.links,
        model,
        objective=objective,
        constraints=cons,
        epoch=epoch,
        options=options,
    )
    rescored = _rescore(current, now, model, objective, cons)
    adopt = should_adopt(rescored, candidate, min_gain=min_gain)
    reason = f"{decision.reason}; {adopt.reason}"
    return ReplanOutcome(candidate if adopt.act else None, reason, candidate, drift=decision.drift)


def _rescore(
    current: Plan | None,
    now: MeshSnapshot,
    model: ModelProfile,
    objective: Objective,
    constraints: PlanConstraints,
) -> Plan | None:
    if current is None:
        return None
    try:
        return evaluate(
            placement(current),
            now.devices,
            now.links,
            model,
            objective=objective,
            constraints=constraints,
            epoch=current.epoch,
        )
    except (InsufficientCapacity, ValueError):
        return None


def alive_pipelines(plan_: Plan, live_peers: Sequence[PeerId]) -> int:
    """How many of the plan's pipelines have every peer alive."""
    live = set(live_peers)
    return sum(1 for p in plan_.pipelines if p.peers <= live)


__all__ = [
    "DEFAULT_DRIFT",
    "DEFAULT_MIN_GAIN",
    "DRIFT_HOLD_MAX_S",
    "DRIFT_HOLD_MIN_S",
    "DriftHold",
    "MeshSnapshot",
    "ReplanOutcome",
    "Verdict",
    "alive_pipelines",
    "announced_plans",
    "coordinator",
    "gain",
    "newest",
    "newest_in_view",
    "replan",
    "should_adopt",
    "should_replan",
    "supersedes",
]
