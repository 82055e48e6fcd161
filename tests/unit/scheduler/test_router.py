"""route(plan, load, request): affinity, health, least expected completion time."""

from __future__ import annotations

import pytest

from hetmesh.errors import NoRoute
from hetmesh.scheduler import MeshLoad, PipelineLoad, Plan, RouteRequest, plan, route
from hetmesh.scheduler.announcement import Host
from hetmesh.scheduler.router import expected_completion_s, token_period_s
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


@pytest.fixture
def three_equal() -> Plan:
    """Three equal single-device replicas."""
    m = toy_model(8)
    big = 1 << 34
    devs = [device(n, memory=big, flops=1e15, bandwidth=1e11) for n in ("a", "b", "c")]
    out = plan(devs, full_links(devs), m, objective="throughput", constraints=BARE)
    assert len(out.pipelines) == 3
    return out


def place(
    p: Plan, streams: int, *, local: str = "", **sharing: object
) -> dict[frozenset[str], int]:
    """Route ``streams`` requests one after another, each counted on its pipeline."""
    sessions = {x.key: 0 for x in p.pipelines}
    for _ in range(streams):
        load = MeshLoad(pipelines={k: PipelineLoad(active_sessions=n) for k, n in sessions.items()})
        chosen = route(p, load, RouteRequest(max_new_tokens=64), local=local, fed=True, **sharing)
        sessions[chosen.key] += 1
    return {x.peers: sessions[x.key] for x in p.pipelines}


def test_route_packs_replicas_that_share_cores_into_batched_rounds(three_equal: Plan) -> None:
    """Three nodes on one two-core machine: eight streams fill two replicas' rounds (a
    round of four costs little more than one) instead of time-slicing all three."""
    cheap_rows = {x.key: 0.2 for x in three_equal.pipelines}
    one_host = {peer: Host(key="h", cores=2.0, share=1.0) for peer in ("a", "b", "c")}
    # separate machines: spread over all three
    assert sorted(place(three_equal, 8, row_costs=cheap_rows).values()) == [2, 3, 3]
    # one machine of two cores: two replicas of four, the gateway's own ("c") left idle
    packed = place(three_equal, 8, local="c", row_costs=cheap_rows, hosts=one_host)
    assert packed == {frozenset({"a"}): 4, frozenset({"b"}): 4, frozenset({"c"}): 0}
    # rows as dear as steps of their own: three busy replicas on two cores still slow
    # every session by half, so the third stays idle while it would slow the others
    linear = place(three_equal, 8, local="c", hosts=one_host)
    assert linear[frozenset({"c"})] == 0
    # enough cores for all three: spread again
    roomy = {peer: Host(key="h", cores=4.0, share=1.0) for peer in ("a", "b", "c")}
    spread = place(three_equal, 8, local="c", row_costs=cheap_rows, hosts=roomy)
    assert sorted(spread.values()) == [2, 3, 3]


def test_cores_of_other_hosts_do_not_slow_a_pipeline(three_equal: Plan) -> None:
    """Only peers announcing the same host key share cores."""
    cheap_rows = {x.key: 0.2 for x in three_equal.pipelines}
    hosts = {
        "a": Host(key="h1", cores=1.0, share=1.0),
        "b": Host(key="h1", cores=1.0, share=1.0),
        "c": Host(key="h2", cores=1.0, share=1.0),
    }
    placed = place(three_equal, 8, row_costs=cheap_rows, hosts=hosts)
    # "a" and "b" share one core: together they do one replica's work; "c" has its own
    assert placed[frozenset({"c"})] == 4
    assert placed[frozenset({"a"})] + placed[frozenset({"b"})] == 4
    assert 0 in (placed[frozenset({"a"})], placed[frozenset({"b"})])


def test_token_period_with_cheap_rows(three_equal: Plan) -> None:
    pipe = three_equal.pipelines[0]
    assert token_period_s(pipe, 1) == pytest.approx(pipe.decode_latency_s)
    linear = token_period_s(pipe, 4)
    cheap = token_period_s(pipe, 4, row_cost=0.2)
    assert linear == pytest.approx(max(pipe.decode_latency_s, 4 * pipe.bottleneck_s))
    assert cheap == pytest.approx(max(pipe.decode_latency_s, 1.6 * pipe.bottleneck_s))
