"""A plan tick re-derives nothing from records that did not change (fast-cut-7a).

Real ed25519 identities sign the plan (the follower checks it with libp2p's
keys); the peer view is built from plain records as the node builds it.
"""

from __future__ import annotations

import dataclasses

import pytest
from libp2p import generate_new_ed25519_identity
from libp2p.peer.id import ID

import hetmesh.node.plan_follower as follower_module
import hetmesh.scheduler.plan_trust as plan_trust
from hetmesh.discovery.wire import Announcement, Load
from hetmesh.node.config import ServingConfig
from hetmesh.node.peer_view import PeerState, PeerView
from hetmesh.node.plan_follower import PlanFollower
from hetmesh.resources import LinkProfile
from hetmesh.scheduler import PlanConstraints, evaluate
from hetmesh.scheduler.announcement import (
    ServingAnnouncement,
    read_serving,
    serving_extra,
    serving_stages,
)
from hetmesh.scheduler.records import Plan
from tests.unit.scheduler.sched_helpers import cpu_device, toy_cpu_model

MODEL = toy_cpu_model()
LIMITS = PlanConstraints(max_context_tokens=128, reserve_bytes=0, reserve_fraction=0.0)


def _identity() -> tuple[str, object]:
    pair = generate_new_ed25519_identity()
    return ID.from_pubkey(pair.public_key).to_base58(), pair.private_key


# the coordinator is the lowest id with no plan followed yet: sort so "boss" is it
(BOSS, BOSS_KEY), (ME, ME_KEY) = sorted((_identity(), _identity()), key=lambda x: x[0])
DEVICES = (cpu_device(BOSS), cpu_device(ME))
LINKS = tuple(
    LinkProfile(src=a, dst=b, rtt_s=1e-3, bandwidth_bps=1e9)
    for a in (BOSS, ME)
    for b in (BOSS, ME)
    if a != b
)


def _plan(epoch: int) -> Plan:
    half = MODEL.num_units // 2
    found = evaluate(
        [[(BOSS, "cpu", 0, half), (ME, "cpu", half, MODEL.num_units)]],
        DEVICES,
        LINKS,
        MODEL,
        constraints=LIMITS,
        epoch=epoch,
    )
    assert found is not None
    return found


def _record(peer: str, state: ServingAnnouncement, seq: int = 1) -> Announcement:
    device = next(d for d in DEVICES if d.peer_id == peer)
    return Announcement(
        version="1",
        peer_id=peer,
        boot_id=1,
        seq=seq,
        addrs=(),
        devices=(device,),
        links=tuple(link for link in LINKS if link.src == peer),
        stages=tuple(serving_stages(state)),
        extra=serving_extra(state),
        load=Load(),
    )


def _follower(me: str, key: object) -> PlanFollower:
    return PlanFollower(
        me=me,
        profile=MODEL,
        constraints=LIMITS,
        config=ServingConfig(),
        started_at=0.0,
        key=key,
        bytes_of=lambda _weights: None,
    )


def _boss_record(epoch: int, seq: int = 1) -> Announcement:
    plan = _plan(epoch)
    signature = _follower(BOSS, BOSS_KEY).sign(plan)
    state = ServingAnnouncement(model=MODEL.name, plan=plan, plan_signature=signature)
    return _record(BOSS, state, seq)


def _view(record: Announcement) -> PeerView:
    serving = read_serving(record.extra, record.stages, plan_of=None)
    return PeerView.of(MODEL.name, [PeerState(record.peer_id, serving, record)])


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often a tick parsed an offer and encoded a plan to check its signature."""
    calls = {"read_offer": 0, "plan_message": 0}

    def counting(name: str, module: object, real: object) -> None:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(module, name, wrapper)

    counting("read_offer", follower_module, follower_module.read_offer)
    counting("plan_message", plan_trust, plan_trust.plan_message)
    return calls


def test_plan_follower_reads_an_unchanged_plan_once(counted: dict[str, int]) -> None:
    """A record that changed elsewhere (its counters, its memory: a new record object
    every tick) but announces the same plan is not parsed or judged again."""
    me = _record(ME, ServingAnnouncement(model=MODEL.name))
    boss = _boss_record(epoch=4)
    follower = _follower(ME, ME_KEY)
    first = follower.step(me, _view(boss), now=10.0)
    assert [plan.epoch for plan, _ in first.adopted] == [4]  # followed: the boss signed it
    assert counted["read_offer"] == 1
    assert counted["plan_message"] >= 1  # its signature was checked over the plan's JSON
    # judged once more against the plan now followed; from then on, the same plan
    # entries: nothing parsed or encoded again
    assert follower.step(me, _view(boss), now=11.0).adopted == ()
    encoded = counted["plan_message"]
    for seq, now in ((2, 12.0), (3, 13.0), (4, 14.0)):
        changed = dataclasses.replace(
            boss, seq=seq, extra={**boss.extra, "gateway": {"tokens_out": seq}}
        )
        assert follower.step(me, _view(changed), now=now).adopted == ()
    assert counted == {"read_offer": 1, "plan_message": encoded}
    assert follower.plan is not None
    assert follower.plan.epoch == 4


def test_plan_follower_judges_a_changed_record_afresh(counted: dict[str, int]) -> None:
    me = _record(ME, ServingAnnouncement(model=MODEL.name))
    follower = _follower(ME, ME_KEY)
    follower.step(me, _view(_boss_record(epoch=4)), now=10.0)
    before = dict(counted)
    newer = _boss_record(epoch=5, seq=2)
    step = follower.step(me, _view(newer), now=11.0)
    assert [plan.epoch for plan, _ in step.adopted] == [5]
    assert counted["read_offer"] == before["read_offer"] + 1
    assert counted["plan_message"] > before["plan_message"]
    # a forged signature on an equal-looking record is refused, not taken from the cache
    forged_state = dataclasses.replace(
        read_serving(newer.extra, newer.stages),
        plan=_plan(6),  # signed for epoch 5's plan, not this one
    )
    forged = _record(BOSS, forged_state, seq=3)
    assert follower.step(me, _view(forged), now=12.0).adopted == ()
    assert follower.plan is not None
    assert follower.plan.epoch == 5
    assert BOSS in follower.refused


def test_plan_follower_judges_an_offer_again_when_the_followed_plan_changes() -> None:
    """The verdict cache keys on what plan_refusal reads: the same offer judged against
    another followed plan or other devices is judged again (same outcome as a fresh
    follower's)."""
    me = _record(ME, ServingAnnouncement(model=MODEL.name))
    boss = _boss_record(epoch=4)
    cached, fresh = _follower(ME, ME_KEY), _follower(ME, ME_KEY)
    cached.step(me, _view(boss), now=10.0)
    cached.coordination = dataclasses.replace(cached.coordination, plan=None)  # forget it
    fresh_step = fresh.step(me, _view(boss), now=11.0)
    cached_step = cached.step(me, _view(boss), now=11.0)
    assert [p.epoch for p, _ in cached_step.adopted] == [p.epoch for p, _ in fresh_step.adopted]


def test_plan_follower_reads_the_constraints_again_only_when_their_entries_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The constraints the announcements give (calibrations, hosts, formats) are worked
    out again when one of those entries changes, not for a counter; a calibration
    announced later is planned on."""
    import hetmesh.node.calibration as calibration
    from hetmesh.scheduler.announcement import Calibration

    calls = []
    real = calibration.calibrated_constraints

    def counting(*args: object, **kwargs: object) -> PlanConstraints:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(calibration, "calibrated_constraints", counting)
    me = _record(ME, ServingAnnouncement(model=MODEL.name))
    boss = _boss_record(epoch=4)
    follower = _follower(ME, ME_KEY)
    for now in (10.0, 11.0, 12.0):
        counter = {"gateway": {"tokens_out": int(now)}}
        follower.step(me, _view(dataclasses.replace(boss, extra={**boss.extra, **counter})), now)
    assert len(calls) == 1
    measured = Calibration(
        model=MODEL.name,
        device="cpu",
        block_step_s=0.002,
        context_tokens=LIMITS.calibration_context_tokens,
    )
    calibrated = dataclasses.replace(boss, extra={**boss.extra, "calibration": measured.to_wire()})
    follower.step(me, _view(calibrated), now=13.0)
    assert len(calls) == 2
    key = next(iter(real(LIMITS, MODEL.name, [(BOSS, calibrated.extra)]).block_step_s_by_device))
    mesh, _ = follower._view(me, _view(calibrated), 14.0)
    assert mesh.constraints.block_step_s_by_device == {key: 0.002}
    assert len(calls) == 2
