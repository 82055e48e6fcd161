"""Whether a request waiting for a route can still get one: decided here, purely.

A gateway with no ready pipeline waits (:meth:`~hetmesh.node.route_chooser.RouteChooser.choose`).
Waiting helps while the plan it follows can still become ready: its peers are loading
stages, or a coordinator is placing the model again after a peer left. It cannot help
once the coordinator says the live members cannot hold the model (its verdict,
``insufficient``) and no pipeline of the plan followed has every peer alive: the
request then fails at once, naming the memory missing and the units that lost their
host, instead of after the whole route wait.

Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from hetmesh.resources import PeerId
from hetmesh.scheduler.records import Plan


def lost_units(plan: Plan, live: Set[PeerId]) -> list[tuple[int, int, PeerId]]:
    """The stages of ``plan`` whose peer is not in ``live``: (start, end, peer), in unit
    order, each once."""
    found = {(s.start, s.end, s.peer_id) for p in plan.pipelines for s in p.stages}
    return sorted(x for x in found if x[2] not in live)


def mesh_verdict(me: PeerId, boss: PeerId | None, own: str, announced: Mapping[PeerId, str]) -> str:
    """Why the coordinator cannot place the model, as this node knows it ("" if it can).

    ``boss``: the coordinator this node's last plan step named (None: not yet); ``own``:
    this node's own verdict (only the coordinator's is current: a node that once
    coordinated keeps its last one); ``announced``: each live member's announced
    verdict. Without a known coordinator, any verdict counts.
    """
    if boss is None:
        return own or next((v for v in announced.values() if v), "")
    if boss == me:
        return own
    return announced.get(boss, "")


def hopeless(plan: Plan | None, live: Set[PeerId], verdict: str) -> str:
    """Why waiting for a route cannot end in one ("" while it can).

    ``plan``: the plan followed (None: none yet); ``live``: the live members, the
    viewer included; ``verdict``: why the coordinator cannot place the model ("" when
    it can, or when it has not said).
    """
    if not verdict:
        return ""
    if plan is None:
        return verdict
    if any(p.peers <= live for p in plan.pipelines):
        return ""  # a pipeline of live peers may still become ready: wait for it
    lost = lost_units(plan, live)
    if not lost:
        return verdict
    named = ", ".join(f"units [{a},{b}) (their host {peer} left)" for a, b, peer in lost)
    return f"{verdict}; no live member holds {named}"


__all__ = ["hopeless", "lost_units", "mesh_verdict"]
