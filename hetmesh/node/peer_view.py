"""What the live peers announce, read once per record version: the one peer view.

Every reader of peers' serving state asks a :class:`PeerView` rather than
parsing records itself: the node's routing and planning (built from its
discovery entries by :class:`PeerViews`, once per record version), the
dashboard feed (:mod:`hetmesh.node.events`), ``hetmesh status``
(:mod:`hetmesh.cli.status_view`) and the readiness of a status view
(:mod:`hetmesh.node.readiness`), which build one from a status view with
:meth:`PeerView.of_status`. So "which stages are ready" and "the newest plan"
are decided here, once. Pure and immutable: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetmesh.discovery.wire import Announcement
from hetmesh.node.readiness import StageKey, ready_pipelines
from hetmesh.resources import PeerId
from hetmesh.scheduler.announcement import (
    Calibration,
    Host,
    PlanParser,
    ServingAnnouncement,
    read_serving,
)
from hetmesh.scheduler.records import Pipeline, Plan, Stage

ALIVE = frozenset({"self", "alive"})


class Entry(Protocol):
    """A discovery entry: a peer and its record (None until one arrived)."""

    @property
    def peer_id(self) -> PeerId: ...

    @property
    def record(self) -> Announcement | None: ...


@dataclass(frozen=True, slots=True)
class PeerState:
    """One peer: its record (None in a status view), health, and serving state."""

    peer_id: PeerId
    serving: ServingAnnouncement
    record: Announcement | None = None
    health: str = "alive"


@dataclass(frozen=True, slots=True)
class PeerView:
    """The peers' announced state; ``model``: the model the viewer serves ("": any)."""

    model: str = ""
    peers: tuple[PeerState, ...] = ()
    _by_peer: Mapping[PeerId, PeerState] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: str, peers: Iterable[PeerState]) -> PeerView:
        found = tuple(peers)
        return cls(model, found, {p.peer_id: p for p in found})

    @classmethod
    def of_status(cls, view: Mapping[str, Any], plan_of: PlanParser | None = None) -> PeerView:
        """The peers of a status view (``Discovery.view()``), every health; ``plan_of``
        parses their plans (None: plans are not read)."""
        peers = []
        for p in view.get("peers") or ():
            record = p.get("record") or {}
            serving = read_serving(record.get("extra"), record.get("stages"), plan_of=plan_of)
            peers.append(
                PeerState(str(p.get("peer_id")), serving, health=str(p.get("health", "?")))
            )
        return cls.of("", peers)

    # -- per peer ---------------------------------------------------------------

    def state(self, peer: PeerId) -> ServingAnnouncement | None:
        found = self._by_peer.get(peer)
        return found.serving if found is not None else None

    def record(self, peer: PeerId) -> Announcement | None:
        found = self._by_peer.get(peer)
        return found.record if found is not None else None

    def calibration(self, peer: PeerId) -> Calibration | None:
        state = self.state(peer)
        return state.calibration if state is not None else None

    def prefix_summary(self, stage: Stage) -> frozenset[int]:
        """The prefix summary a peer announces for ``stage`` (empty: none)."""
        state = self.state(stage.peer_id)
        return state.prefix_summary(stage.start, stage.end) if state else frozenset()

    # -- the mesh ---------------------------------------------------------------

    @property
    def members(self) -> tuple[PeerState, ...]:
        """Live peers serving the viewer's model."""
        return tuple(
            p
            for p in self.peers
            if p.health in ALIVE and (not self.model or p.serving.model == self.model)
        )

    def hosts(self) -> dict[PeerId, Host]:
        """The cores each peer announces it computes on (where it does)."""
        return {p.peer_id: p.serving.host for p in self.peers if p.serving.host is not None}

    def ready_stages(self) -> set[StageKey]:
        """The stages live members announce loaded and not retiring."""
        return {
            (m.peer_id, s.start, s.end)
            for m in self.members
            for s in m.serving.stages
            if s.ready and (not self.model or s.model == self.model)
        }

    def insufficient(self) -> str:
        """Why a member's coordinator cannot place the model ("" when none says so)."""
        return next((m.serving.insufficient for m in self.members if m.serving.insufficient), "")

    def newest_plan(self) -> Plan | None:
        """The newest plan any peer follows (plans read with the view's ``plan_of``)."""
        from hetmesh.scheduler.replan import newest

        return newest(p.serving.plan for p in self.peers if p.serving.plan is not None)


class PeerViews:
    """Builds the node's :class:`PeerView` from its discovery entries, parsing each
    record once and reusing the view while no record changed."""

    def __init__(self, model: str, entries: Callable[[], Iterable[Entry]]) -> None:
        """``entries``: the live discovery entries now."""
        self.model = model
        self._entries = entries
        self._view = PeerView.of(model, ())

    def current(self) -> PeerView:
        """The view of the live entries with a record (plans not parsed)."""
        peers = []
        for e in self._entries():
            record = e.record
            if record is None:
                continue
            seen = self._view._by_peer.get(e.peer_id)
            if seen is None or seen.record is not record:
                serving = read_serving(record.extra, record.stages, plan_of=None)
                seen = PeerState(e.peer_id, serving, record)
            peers.append(seen)
        if len(peers) != len(self._view.peers) or any(
            a is not b for a, b in zip(peers, self._view.peers, strict=True)
        ):
            self._view = PeerView.of(self.model, peers)
        return self._view


def ready_stages_in_view(view: Mapping[str, Any]) -> set[StageKey]:
    """The ready stages a status view shows (its own and its live peers'), as its
    :class:`PeerView` decides them."""
    return PeerView.of_status(view).ready_stages()


def ready_pipelines_in_view(view: Mapping[str, Any]) -> tuple[Pipeline, ...]:
    """The pipelines of a status view's newest plan whose every stage is ready."""
    from hetmesh.scheduler.announcement import parse_plan

    peers = PeerView.of_status(view, plan_of=parse_plan)
    return ready_pipelines(peers.newest_plan(), peers.ready_stages())


__all__ = [
    "ALIVE",
    "Entry",
    "PeerState",
    "PeerView",
    "PeerViews",
    "ready_pipelines_in_view",
    "ready_stages_in_view",
]
