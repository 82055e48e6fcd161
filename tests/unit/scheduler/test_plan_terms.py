"""Plan terms (issue 45, item 7): a plan's signature covers the term its coordinator
signed it in; a node never follows a plan of a term before its own plan's, so an old
plan of a former coordinator is not adopted again, whatever its epoch."""

from __future__ import annotations

import dataclasses

from hetmesh.scheduler.coordination import (
    CoordinatorConfig,
    CoordinatorState,
    Publish,
    decide,
)
from hetmesh.scheduler.plan_trust import Offer, PlanSignature, plan_message, plan_refusal
from tests.unit.scheduler.test_coordination import AB, MODEL, view
from tests.unit.scheduler.test_plan_trust import LIMITS, MESH, SPLIT, sign, verify
from tests.unit.scheduler.test_plan_trust import MODEL as TRUST_MODEL


def offer(plan, signer: str) -> Offer:
    signature = PlanSignature(signer=signer, signature=sign(signer, plan_message(plan)))
    return Offer(plan, signature, relayed_by="h")


def refusal(offered: Offer, current, current_signer: str) -> str:
    return plan_refusal(
        offered,
        coordinator="a",
        current=current,
        current_signer=current_signer,
        devices=MESH.devices,
        model=TRUST_MODEL,
        constraints=LIMITS,
        verify=verify,
    )


def test_a_former_coordinators_old_plan_is_refused_whatever_its_epoch() -> None:
    """``a`` coordinated (term 0), then ``c`` (term 1, up to epoch 9), then ``c`` left and
    the succession named ``a`` again: a member relays ``a``'s old plan. Before terms,
    it was adopted (signed by the coordinator, no window across coordinators)."""
    old = SPLIT.with_epoch(4).with_term(0)
    followed = SPLIT.with_epoch(9).with_term(1)
    assert "before the term 1" in refusal(offer(old, "a"), followed, "c")
    # even an old plan at a high epoch: its term is what is refused
    assert "before the term 1" in refusal(offer(old.with_epoch(12), "a"), followed, "c")
    # a's plan of its new term is followed
    assert refusal(offer(SPLIT.with_epoch(10).with_term(2), "a"), followed, "c") == ""
    # the term is signed: relabelling the old plan's term breaks its signature
    relabelled = Offer(old.with_term(2), offer(old, "a").signature, relayed_by="h")
    assert refusal(relabelled, followed, "c") == "a forged signature"


def published(step) -> list:
    return [a.plan for a in step.actions if isinstance(a, Publish)]


def test_a_coordinator_taking_over_numbers_its_term_above_every_term_announced() -> None:
    config = CoordinatorConfig(model=MODEL)
    first = decide(view(AB), CoordinatorState(), config)
    (plan,) = published(first)
    assert plan.term == 0
    # another coordinator's term (5) was followed since: taking over, a signs in term 6
    state = dataclasses.replace(first.state, plan=plan.with_term(5), signer="b")
    back = dataclasses.replace(view(AB, following=(("b", "a"),)), term_floor=5)
    (again,) = published(decide(back, state, config))
    assert again.term == 6
    assert again.epoch == plan.epoch + 1


def test_a_coordinator_behind_a_term_followed_elsewhere_starts_a_new_one() -> None:
    """Two halves that planned apart: the one whose coordinator stays re-signs its plan
    above the other half's term, so those members can follow it."""
    config = CoordinatorConfig(model=MODEL)
    first = decide(view(AB), CoordinatorState(), config)
    settled = decide(view(AB, plans=tuple(published(first))), first.state, config)
    assert not published(settled)  # its own term: nothing new to sign
    ahead = dataclasses.replace(view(AB), term_floor=3)
    (renewed,) = published(decide(ahead, settled.state, config))
    assert renewed.term == 4
    assert renewed.pipelines == settled.state.plan.pipelines
