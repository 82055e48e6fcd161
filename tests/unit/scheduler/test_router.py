"""route(plan, load, request): affinity, health, least expected completion time."""

from __future__ import annotations

import pytest

from hetmesh.errors import NoRoute
from hetmesh.scheduler import MeshLoad, PipelineLoad, Plan, RouteRequest, plan, route
from hetmesh.scheduler.router import expected_completion_s
from tests.unit.scheduler.sched_helpers import BARE, device, full_links, toy_model


@pytest.fixture
def three_replicas() -> Plan:
    """Three single-device replicas: "fast" is 4× faster than "mid" and "slow"."""
    m = toy_model(8)
    big = 1 << 34
    devs = [
        device("fast", memory=big, flops=1e15, bandwidth=4e11),
        device("mid", memory=big, flops=1e15, bandwidth=1e11),
        device("slow", memory=big, flops=1e15, bandwidth=1e11),
    ]
    out = plan(devs, full_links(devs), m, objective="throughput", constraints=BARE)
    assert len(out.pipelines) == 3
    return out


def by_peer(p: Plan, peer: str) -> str:
    return next(x.key for x in p.pipelines if peer in x.peers)


def test_route_idle_mesh_picks_fastest(three_replicas: Plan) -> None:
    chosen = route(three_replicas, MeshLoad(), RouteRequest(prompt_tokens=100, max_new_tokens=50))
    assert chosen.peers == frozenset({"fast"})


def test_route_busy_fast_pipeline_loses_to_idle_one(three_replicas: Plan) -> None:
    fast = by_peer(three_replicas, "fast")
    request = RouteRequest(prompt_tokens=10, max_new_tokens=50)
    light = MeshLoad(pipelines={fast: PipelineLoad(active_sessions=2)})
    assert route(three_replicas, light, request).peers == {"fast"}  # 3× queue, 4× speed
    heavy = MeshLoad(pipelines={fast: PipelineLoad(active_sessions=6)})
    assert route(three_replicas, heavy, request).peers == {"mid"}  # ties go to plan order


def test_route_session_affinity_while_healthy(three_replicas: Plan) -> None:
    slow = by_peer(three_replicas, "slow")
    load = MeshLoad(sessions={"s1": slow})
    request = RouteRequest(session_id="s1", max_new_tokens=10)
    assert route(three_replicas, load, request).peers == {"slow"}
    sick = MeshLoad(sessions={"s1": slow}, unhealthy_peers=("slow",))
    assert route(three_replicas, sick, request).peers == {"fast"}
    other = RouteRequest(session_id="s2", max_new_tokens=10)
    assert route(three_replicas, load, other).peers == {"fast"}


def test_route_skips_unhealthy_and_raises_no_route(three_replicas: Plan) -> None:
    request = RouteRequest(max_new_tokens=1)
    load = MeshLoad(unhealthy_peers=("fast",))
    assert "fast" not in route(three_replicas, load, request).peers
    with pytest.raises(NoRoute, match="unhealthy peers: fast, mid, slow"):
        route(three_replicas, MeshLoad(unhealthy_peers=("fast", "mid", "slow")), request)


def test_expected_completion_grows_with_queue(three_replicas: Plan) -> None:
    pipe = three_replicas.pipelines[0]
    request = RouteRequest(prompt_tokens=1000, max_new_tokens=10)
    idle = expected_completion_s(pipe, PipelineLoad(), request)
    assert idle == pytest.approx(pipe.prefill_s_per_1k + 10 * pipe.decode_latency_s)
    busy = expected_completion_s(pipe, PipelineLoad(active_sessions=3, queued_requests=1), request)
    assert busy > idle


def test_route_records_round_trip() -> None:
    load = MeshLoad(
        pipelines={"k": PipelineLoad(active_sessions=1)},
        unhealthy_peers=("x",),
        sessions={"s": "k"},
    )
    assert MeshLoad.from_wire(load.to_wire()) == load
    with pytest.raises(ValueError, match="non-negative"):
        RouteRequest(prompt_tokens=-1)


def test_route_prefers_the_gateways_own_pipeline_within_the_slack(three_replicas: Plan) -> None:
    request = RouteRequest(max_new_tokens=10)
    fast, mid = by_peer(three_replicas, "fast"), by_peer(three_replicas, "mid")
    # "fast" wins by 4x, far past the slack, whoever the gateway is
    assert route(three_replicas, MeshLoad(), request, local="mid").peers == {"fast"}
    # with "fast" busy, "mid" and "slow" tie: a gateway on "slow" keeps the session home
    busy_fast = MeshLoad(pipelines={fast: PipelineLoad(active_sessions=6)})
    assert route(three_replicas, busy_fast, request).peers == {"mid"}
    assert route(three_replicas, busy_fast, request, local="slow").peers == {"slow"}
    # a busy home loses to an idle equal elsewhere
    busy_home = MeshLoad(
        pipelines={fast: PipelineLoad(active_sessions=6), mid: PipelineLoad(active_sessions=3)}
    )
    assert route(three_replicas, busy_home, request, local="mid").peers == {"slow"}
    # a peer holding no pipeline of its own changes nothing
    assert route(three_replicas, busy_fast, request, local="elsewhere").peers == {"mid"}


def test_route_sends_a_fed_stream_off_the_gateways_node_within_the_slack(
    three_replicas: Plan,
) -> None:
    request = RouteRequest(max_new_tokens=10)
    fast, mid = by_peer(three_replicas, "fast"), by_peer(three_replicas, "mid")
    assert all(len(p.stages) == 1 for p in three_replicas.pipelines)
    # "fast" wins by 4x, far past the slack, even on the gateway's own node
    assert route(three_replicas, MeshLoad(), request, local="fast", fed=True).peers == {"fast"}
    # with "fast" busy, "mid" and "slow" tie: a gateway on either sends it to the other
    busy_fast = MeshLoad(pipelines={fast: PipelineLoad(active_sessions=6)})
    assert route(three_replicas, busy_fast, request, local="slow", fed=True).peers == {"mid"}
    assert route(three_replicas, busy_fast, request, local="mid", fed=True).peers == {"slow"}
    # unfed, the same gateway keeps it home
    assert route(three_replicas, busy_fast, request, local="mid").peers == {"mid"}
    # an away pipeline past the slack loses to an idle home
    busy_away = MeshLoad(
        pipelines={fast: PipelineLoad(active_sessions=6), mid: PipelineLoad(active_sessions=3)}
    )
    assert route(three_replicas, busy_away, request, local="slow", fed=True).peers == {"slow"}
