"""The node's pure parts: the stage host's reconcile, the peer view, routing inputs.

Each is decided once from plain records (no trio, no libp2p), so each is
tested as a table here; the node's integration tests drive the executors.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hetmesh.discovery.wire import Announcement, Load
from hetmesh.node.peer_view import PeerState, PeerView, PeerViews
from hetmesh.node.routing import chunk_costs, pipeline_loads, sharing
from hetmesh.node.stage_host import reconcile
from hetmesh.scheduler.announcement import (
    Calibration,
    Host,
    ServedStage,
    ServingAnnouncement,
    serving_extra,
    serving_stages,
)
from tests.unit.node.test_readiness import PLAN


@pytest.mark.parametrize(
    ("mine", "served", "loading", "draining", "load", "retiring"),
    [
        # a first plan: load what it gives us
        ({(0, 4)}, {}, set(), False, ((0, 4),), {}),
        # a swap: the old stage keeps serving until the new one is loaded
        ({(0, 8)}, {(0, 4): False}, set(), False, ((0, 8),), {(0, 4): False}),
        ({(0, 8)}, {(0, 4): False}, {(0, 8)}, False, (), {(0, 4): False}),
        # loaded: the old one retires
        ({(0, 8)}, {(0, 4): False, (0, 8): False}, set(), False, (), {(0, 4): True, (0, 8): False}),
        # a retiring stage stays retiring while a later stage loads
        (
            {(0, 2), (2, 8)},
            {(0, 4): True, (0, 2): False},
            {(2, 8)},
            False,
            (),
            {(0, 4): True, (0, 2): False},
        ),
        # draining: everything retires, nothing loads
        ({(0, 8), (0, 4)}, {(0, 4): False}, set(), True, (), {(0, 4): True}),
    ],
)
def test_reconcile_loads_the_new_stages_and_retires_the_old_ones_once_they_are_loaded(
    mine, served, loading, draining, load, retiring
) -> None:
    step = reconcile(mine, served, loading, draining)
    assert step.load == load
    assert dict(step.retiring) == retiring


def _record(
    peer: str, state: ServingAnnouncement, load: Load | None = None, sent_at_s: float = 0.0
) -> Announcement:
    return Announcement(
        version="1",
        peer_id=peer,
        boot_id=1,
        seq=1,
        addrs=(),
        stages=tuple(serving_stages(state)),
        extra=serving_extra(state),
        load=load or Load(),
        sent_at_s=sent_at_s,
    )


@dataclass(frozen=True)
class _Entry:
    peer_id: str
    record: Announcement | None


def _calibration(row_cost: float, chunk_cost: float) -> Calibration:
    return Calibration(
        model="m",
        device="cpu",
        block_step_s=0.001,
        context_tokens=128,
        weights="int4",
        prefill_chunk_cost=chunk_cost,
        row_cost=row_cost,
    )


def test_the_node_view_holds_members_ready_stages_and_is_rebuilt_only_on_a_new_record() -> None:
    b = ServingAnnouncement(
        model="m",
        stages=(
            ServedStage(model="m", start=4, end=8, ready=True),
            ServedStage(model="m", start=0, end=4, ready=False),
        ),
        host=Host(key="h", cores=2, share=1),
        insufficient="too small",
    )
    other = ServingAnnouncement(
        model="other", stages=(ServedStage(model="other", start=0, end=8, ready=True),)
    )
    entries = [_Entry("B", _record("B", b)), _Entry("X", _record("X", other)), _Entry("N", None)]
    views = PeerViews("m", lambda: entries)
    view = views.current()
    assert [m.peer_id for m in view.members] == ["B"]  # X serves another model
    assert view.ready_stages() == {("B", 4, 8)}
    assert view.insufficient() == "too small"
    assert view.hosts() == {"B": Host(key="h", cores=2, share=1)}
    assert views.current() is view  # no record changed: the same view
    entries[0] = _Entry("B", _record("B", b))
    assert views.current() is not view


def test_a_status_views_newest_plan_and_ready_stages_come_from_the_same_view() -> None:
    def peer(pid: str, health: str, state: ServingAnnouncement) -> dict[str, object]:
        record = {"stages": serving_stages(state), "extra": serving_extra(state)}
        return {"peer_id": pid, "health": health, "record": record}

    from hetmesh.scheduler.announcement import parse_plan

    older = ServingAnnouncement(plan=PLAN.__class__.from_wire({**PLAN.to_wire(), "epoch": 2}))
    newer = ServingAnnouncement(
        plan=PLAN, stages=(ServedStage(model="m", start=0, end=8, ready=True),)
    )
    view = {"peers": [peer("A", "self", older), peer("C", "dead", newer)]}
    peers = PeerView.of_status(view, plan_of=parse_plan)
    assert peers.newest_plan() == PLAN  # a dead peer's plan still counts as seen
    assert peers.ready_stages() == set()  # its stages do not
    assert PeerView.of_status(view).newest_plan() is None  # plans not read


def test_pipeline_loads_count_our_routes_and_the_others_less_ours() -> None:
    c = ServingAnnouncement(model="m")
    view = PeerView.of(
        "m",
        [
            PeerState("C", c, _record("C", c, Load(active_sessions=3, queue_depth=1))),
            PeerState("B", c, _record("B", c, Load(active_sessions=1))),
        ],
    )

    @dataclass(frozen=True)
    class Hop:
        peer_id: str
        start: int
        end: int

    routes = [(Hop("C", 0, 8),), (Hop("A", 0, 4), Hop("B", 4, 8))]
    loads = pipeline_loads(
        PLAN,
        view,
        me="A",
        routes=routes,
        local_sessions=2,
        local_queue=0,
        counted={"C": 1},
    )
    a_b, c_only = (p.key for p in PLAN.pipelines)
    # ours on A->B: 1; beside ours, A holds 1 more (2 less our 1), B holds 1
    assert loads[a_b].active_sessions == 1 + 1
    assert loads[a_b].queued_requests == 0
    # ours on C: 1; C announced 3, of which 1 ran ours while it was sampled
    assert loads[c_only].active_sessions == 1 + 2
    assert loads[c_only].queued_requests == 1


def test_sharing_and_chunk_costs_read_each_peers_calibration_ours_from_our_announcement() -> None:
    b = ServingAnnouncement(model="m", calibration=_calibration(0.4, 0.0))
    c = ServingAnnouncement(
        model="m", calibration=_calibration(0.2, 1.3), host=Host(key="h", cores=2, share=1)
    )
    view = PeerView.of("m", [PeerState("B", b), PeerState("C", c)])
    mine = ServingAnnouncement(model="m", calibration=_calibration(0.6, 1.1))
    costs, hosts = sharing(PLAN, view, "A", mine)
    a_b, c_only = (p.key for p in PLAN.pipelines)
    assert costs == {a_b: 0.6, c_only: 0.2}  # a pipeline's dearest stage
    assert hosts == {"C": Host(key="h", cores=2, share=1)}
    stages = [s for p in PLAN.pipelines for s in p.stages]
    assert chunk_costs(stages, view, "A", mine) == [1.1, None, 1.3]  # B: not measured
