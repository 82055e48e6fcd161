"""Plan epochs: only signed plans raise the floor, and no floor leaves a coordinator stuck."""

from __future__ import annotations

import dataclasses

from hetmesh.scheduler.coordination import CoordinatorConfig, CoordinatorState, Publish, decide
from hetmesh.scheduler.plan_trust import (
    MAX_EPOCH,
    MAX_FLOOR,
    Offer,
    PlanSignature,
    epoch_floor,
    plan_message,
)
from tests.unit.scheduler.test_coordination import AB, MODEL, SPLIT, view
from tests.unit.scheduler.test_plan_trust import sign, verify

INFLATED = 2**62 - 1  # what the hostile member announced


def _offer(epoch: int, signer: str | None, *, forged: bool = False) -> Offer:
    plan = SPLIT.with_epoch(epoch)
    signature = None
    if signer is not None:
        text = sign(signer, plan_message(plan.with_epoch(epoch + 1) if forged else plan))
        signature = PlanSignature(signer=signer, signature=text)
    return Offer(plan, signature, relayed_by="h")


def test_only_plans_their_signer_signed_raise_the_floor() -> None:
    assert epoch_floor([_offer(INFLATED, None), _offer(7, "a")], verify) == 7
    assert epoch_floor([_offer(INFLATED, "h", forged=True), _offer(7, "a")], verify) == 7
    assert epoch_floor([_offer(INFLATED, None)], verify) == -1
    # a signed one near the limit leaves the coordinator too few epochs: ignored as well
    assert epoch_floor([_offer(MAX_FLOOR + 1, "h"), _offer(9, "b")], verify) == 9
    assert epoch_floor([_offer(MAX_FLOOR, "h")], verify) == MAX_FLOOR


def test_an_inflated_floor_does_not_block_the_coordinator() -> None:
    """Before the fix an unsigned plan at 2**62-1 set the floor: the coordinator's first
    plan took epoch 2**62 and it could publish no other after (2**62+1 is past the
    limit followers accept), so the mesh could never replan."""
    config = CoordinatorConfig(model=MODEL)
    first = decide(dataclasses.replace(view(AB), epoch_floor=INFLATED), CoordinatorState(), config)
    published = [a.plan for a in first.actions if isinstance(a, Publish)]
    assert published
    assert published[0].epoch < MAX_EPOCH - 2**32
    # its next plan (here: it re-signs what it follows, as after another's term) is
    # numbered one epoch up, and still published
    state = dataclasses.replace(first.state, signer="b")
    back = view(AB, following=(("b", "a"),))  # b's term ended: it follows a again
    later = decide(dataclasses.replace(back, epoch_floor=INFLATED), state, config)
    again = [a.plan for a in later.actions if isinstance(a, Publish)]
    assert again
    assert again[0].epoch == published[0].epoch + 1
