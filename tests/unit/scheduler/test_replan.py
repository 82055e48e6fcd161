"""The replanning policy: triggers, adoption threshold, coordinator, epochs."""

from __future__ import annotations

import dataclasses
import random

from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import DeviceProfile
from hetmesh.scheduler import (
    MeshSnapshot,
    coordinator,
    evaluate,
    newest,
    newest_in_view,
    placement,
    plan,
    replan,
    should_adopt,
    should_replan,
    supersedes,
)
from hetmesh.scheduler.replan import DriftHold
from hetmesh.scheduler.synthetic import random_mesh
from tests.unit.scheduler.sched_helpers import device, full_links, toy_model

MODEL = model_profile(KNOWN_SHAPES["llama-7b"], dtype="float16", name="llama-7b")
MODEL_SMALL = toy_model()


def scaled(d: DeviceProfile, factor: float) -> DeviceProfile:
    return DeviceProfile.from_wire(
        {**d.to_wire(), "memory_bandwidth_bps": d.memory_bandwidth_bps * factor}
    )


def snapshot(seed: int = 1, n: int = 5) -> MeshSnapshot:
    devs, links = random_mesh(random.Random(seed), n)
    return MeshSnapshot(devices=tuple(devs), links=tuple(links))


def test_should_replan_on_membership_and_drift_only() -> None:
    base = snapshot()
    assert should_replan(None, base).act
    assert not should_replan(base, base).act
    fewer = MeshSnapshot(devices=base.devices[1:], links=base.links)
    decision = should_replan(base, fewer)
    assert decision.act
    assert "left" in decision.reason
    small = MeshSnapshot(
        devices=(scaled(base.devices[0], 1.19), *base.devices[1:]), links=base.links
    )
    assert not should_replan(base, small).act
    large = MeshSnapshot(
        devices=(scaled(base.devices[0], 1.30), *base.devices[1:]), links=base.links
    )
    assert "drift" in should_replan(base, large).reason


def test_should_adopt_needs_gain_over_threshold() -> None:
    s = snapshot()
    current = plan(s.devices, s.links, MODEL)
    assert should_adopt(None, current).act
    assert not should_adopt(current, current).act  # zero gain: no flapping
    faster = [scaled(d, 2.0) for d in s.devices]
    better = plan(faster, s.links, MODEL)
    assert should_adopt(current, better, min_gain=0.1).act
    assert not should_adopt(current, better, min_gain=10.0).act


def test_replan_publishes_next_epoch_only_when_worth_it() -> None:
    s = snapshot()
    first = replan(None, None, s, MODEL)
    assert first.plan is not None
    assert first.plan.epoch == 0
    same = replan(first.plan, s, s, MODEL)
    assert same.plan is None
    assert "no membership change" in same.reason


def test_replan_after_a_used_device_leaves() -> None:
    gib = 2**30
    devs = [
        device(p, memory=40 * gib, bandwidth=b) for p, b in (("a", 3e11), ("b", 2e11), ("c", 1e11))
    ]
    start = MeshSnapshot(devices=tuple(devs), links=tuple(full_links(devs)))
    first = replan(None, None, start, MODEL)
    assert first.plan is not None
    assert first.plan.pipelines[0].peers == {"a"}
    left = MeshSnapshot(devices=tuple(devs[1:]), links=start.links)
    after = replan(first.plan, start, left, MODEL)
    assert after.plan is not None
    assert after.plan.epoch == 1
    assert after.plan.pipelines[0].peers == {"b"}
    assert "left" in after.reason
    # a faster newcomer that gains less than the threshold is not adopted
    joined = MeshSnapshot(
        devices=(*devs, device("d", memory=40 * gib, bandwidth=3.1e11)), links=start.links
    )
    kept = replan(first.plan, start, joined, MODEL)
    assert kept.plan is None
    assert kept.candidate is not None
    assert "joined" in kept.reason


def test_evaluate_rescores_or_rejects_a_placement() -> None:
    s = snapshot()
    current = plan(s.devices, s.links, MODEL)
    again = evaluate(placement(current), s.devices, s.links, MODEL)
    assert again is not None
    assert again.objective_value == current.objective_value
    used = current.pipelines[0].stages[0].peer_id
    rest = [d for d in s.devices if d.peer_id != used]
    assert evaluate(placement(current), rest, s.links, MODEL) is None


def test_coordinator_is_lowest_live_peer_and_newest_plan_wins() -> None:
    assert coordinator(["peer-c", "peer-a", "peer-b"]) == "peer-a"
    assert coordinator([]) is None
    devs = [device("a"), device("b")]
    m = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")
    p0 = plan(devs, full_links(devs), m, epoch=3)
    p1 = p0.with_epoch(5)
    assert newest([p1, p0]) is p1
    assert newest([p0, p1]) is p1
    assert newest([]) is None


def test_plans_of_one_epoch_are_ordered_the_same_everywhere() -> None:
    # Two nodes that each believed they coordinated can publish different plans
    # of the same epoch: every node must end on the same one, whichever it saw first.
    m = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")
    one = plan([device("a"), device("b")], full_links([device("a"), device("b")]), m, epoch=0)
    other = plan([device("c"), device("d")], full_links([device("c"), device("d")]), m, epoch=0)
    assert one.pipelines != other.pipelines
    winner, loser = (one, other) if newest([one, other]) is one else (other, one)
    assert newest([loser, winner]) is winner
    assert supersedes(winner, loser)
    assert not supersedes(loser, winner)
    assert not supersedes(winner, winner)
    assert supersedes(one, None)
    assert supersedes(winner.with_epoch(1).with_epoch(0), loser)  # by content, not identity
    assert supersedes(loser.with_epoch(1), winner)  # a later epoch always wins


def test_newest_in_view_reads_followed_plans_and_skips_malformed_ones() -> None:
    m = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")
    devs = [device("a"), device("b")]
    p3 = plan(devs, full_links(devs), m, epoch=3)

    def peer(raw: object) -> dict[str, object]:
        return {"peer_id": "x", "health": "alive", "record": {"extra": {"plan": raw}}}

    view = {
        "peers": [
            peer(p3.to_wire()),
            peer({"epoch": 99}),  # malformed: ignored, not fatal
            peer(p3.with_epoch(4).to_wire()),
            {"peer_id": "y", "health": "alive", "record": {"extra": {}}},
        ]
    }
    found = newest_in_view(view)
    assert found is not None
    assert found.epoch == 4
    assert found.pipelines == p3.pipelines
    assert newest_in_view({"peers": []}) is None
    assert newest_in_view({"peers": [peer("not a plan")]}) is None


def test_a_drift_is_held_while_the_plan_settles_but_membership_acts() -> None:
    base = snapshot()
    current = plan(base.devices, base.links, MODEL)
    faster = MeshSnapshot(devices=tuple(scaled(d, 3.0) for d in base.devices), links=base.links)
    held = replan(current, base, faster, MODEL, drift_allowed=False)
    assert held.plan is None
    assert held.held
    assert "held" in held.reason
    free = replan(current, base, faster, MODEL)
    assert free.drift
    assert not free.held
    fewer = MeshSnapshot(devices=base.devices[1:], links=base.links)
    gone = replan(current, base, fewer, MODEL, drift_allowed=False)
    assert not gone.held
    assert not gone.drift
    assert gone.candidate is not None  # a departure is planned for at once


def test_the_drift_hold_grows_with_load_time_and_with_moves_in_a_row() -> None:
    hold = DriftHold(min_s=60.0, max_s=3600.0)
    assert hold.allows(0.0)  # nothing followed yet
    hold.adopted(100.0, drift=False)
    hold.observe(150.0, ready=False)
    assert not hold.allows(200.0)  # not serving yet: measurements mean little
    hold.observe(400.0, ready=True)  # 300 s to load: it stands 600 s once ready
    hold.observe(500.0, ready=True)  # the first ready time is the one kept
    assert hold.hold_s() == 600.0
    assert not hold.allows(999.0)
    assert hold.allows(1000.0)
    hold.adopted(1000.0, drift=True)  # a move drift alone made: the next stands twice as long
    hold.observe(1010.0, ready=True)
    assert hold.hold_s() == 120.0  # max(60, 2 x 10) x 2
    hold.adopted(1200.0, drift=True)
    hold.observe(1210.0, ready=True)
    assert hold.hold_s() == 240.0
    hold.adopted(1500.0, drift=False)  # a membership change resets the streak
    hold.observe(1501.0, ready=True)
    assert hold.hold_s() == 60.0
    hold.adopted(2000.0, drift=False)  # a plan that never serves may still move, late
    assert not hold.allows(2000.0 + 3599.0)
    assert hold.allows(2000.0 + 3600.0)


def slower_links(s: MeshSnapshot, factor: float, pairs: set[tuple[str, str]]) -> MeshSnapshot:
    links = tuple(
        dataclasses.replace(x, rtt_s=x.rtt_s * factor, bandwidth_bps=x.bandwidth_bps / factor)
        if (x.src, x.dst) in pairs
        else x
        for x in s.links
    )
    return dataclasses.replace(s, links=links)


def test_loopback_drift_moves_no_plan_but_a_wire_between_hosts_does() -> None:
    # three CPU nodes; a and b on one host (one identity), c on another
    devs = [device(p, backend="cpu", flops=1e11, bandwidth=2e10) for p in ("a", "b", "c")]
    hosts = (("a", "host-1"), ("b", "host-1"), ("c", "host-2"))
    base = MeshSnapshot(devices=tuple(devs), links=tuple(full_links(devs)), hosts=hosts)
    assert base.colocated("a", "b")
    assert base.colocated("b", "a")
    assert not base.colocated("a", "c")
    assert not base.colocated("c", "b")
    loop = {("a", "b"), ("b", "a")}
    # the loopback probes read 8x longer under CPU load: no drift, no new plan
    loaded = slower_links(base, 8.0, loop)
    assert not should_replan(base, loaded).act
    current = plan(base.devices, base.links, MODEL_SMALL)
    outcome = replan(current, base, loaded, MODEL_SMALL)
    assert outcome.plan is None
    assert outcome.candidate is None
    assert not outcome.drift
    # the same figures on a link between the two hosts are drift
    wire = slower_links(base, 8.0, {("a", "c")})
    decision = should_replan(base, wire)
    assert decision.act
    assert decision.drift
    assert "a -> c" in decision.reason
    # without the hosts announced the loopback's figures count as any link's
    anon = dataclasses.replace(base, hosts=())
    assert should_replan(anon, dataclasses.replace(loaded, hosts=())).drift
    # one end's identity unknown, or an empty one, shares a host with nobody
    half = dataclasses.replace(loaded, hosts=(("a", "host-1"), ("c", "host-2")))
    assert should_replan(base, half).drift
    blank = dataclasses.replace(loaded, hosts=(("a", ""), ("b", ""), ("c", "host-2")))
    assert should_replan(base, blank).drift
    # membership still acts on a colocated mesh, and the hosts travel on the wire
    fewer = dataclasses.replace(loaded, devices=loaded.devices[:2])
    assert "left c" in should_replan(base, fewer).reason
    assert MeshSnapshot.from_wire(base.to_wire()) == base
