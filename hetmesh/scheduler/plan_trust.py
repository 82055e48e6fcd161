"""Which announced plans a node may follow: signed by its coordinator, bounded, sane.

Every member announces the plan it follows, so a plan reaches a node either
from the coordinator itself or relayed by another member. A node follows only
a plan that passes :func:`plan_refusal` (``""``: acceptable; else why not):

1. it is for this model and carries a :class:`PlanSignature`;
2. the signer is the peer this node's own rule names coordinator
   (:func:`~hetmesh.scheduler.replan.coordinator` over the live members it sees),
   whoever relayed it;
3. its term (:attr:`~hetmesh.scheduler.records.Plan.term`, covered by the
   signature) is not before the term of the plan this node follows: a
   coordinator's old plan, relayed again after another coordinator's term,
   is refused whatever its epoch, even once its signer coordinates again (a
   coordinator taking over numbers its term above every term announced,
   :func:`term_floor`);
4. its epoch is at most :data:`MAX_EPOCH` (far below msgpack's 2**64 limit, so
   the next coordinator's ``epoch + 1`` always encodes) and, while the same
   coordinator signs, at most :data:`EPOCH_WINDOW` above the plan followed;
5. the signature verifies (an injected callable: the pure scheduler never
   touches keys or libp2p);
6. it is sane on this node's view: every stage's device is announced by a live
   member, a device's unit ranges are equal or disjoint, every pipeline covers
   the model, no device holds more weight bytes than the memory it announced,
   and no pipeline puts most of the model on one member's unmeasured claims
   (devices with no block step measured, by its calibration or by the steps it
   served) while another device's is measured (:func:`unmeasured_majority`).

The signed message is the plan's wire map, canonically encoded
(:func:`plan_message`), after a domain tag. Only a signed plan raises the epoch
floor a new coordinator numbers its first plan above (:func:`epoch_floor`), and
never to within :data:`FLOOR_HEADROOM` of :data:`MAX_EPOCH`: an unsigned plan at
a huge epoch cannot leave the coordinator without epochs. Pure: no I/O, no clocks.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetmesh.resources import DeviceProfile, ModelProfile, PeerId, WireRecord
from hetmesh.scheduler.records import Plan, PlanConstraints, device_key

MAX_EPOCH = 1 << 62  # headroom below 2**64: epoch + 1 never overflows the wire
EPOCH_WINDOW = 64  # how far one coordinator's next plan may jump past the one followed
FLOOR_HEADROOM = 1 << 32  # epochs a coordinator always has left above the floor
MAX_FLOOR = MAX_EPOCH - FLOOR_HEADROOM
MAX_SIGNATURE_HEX = 1024  # ed25519: 128 hex digits
MAX_PEER_ID_CHARS = 128
PLAN_DOMAIN = b"hetmesh/plan/v1\x00"

# (signer, message, signature) -> whether the signer's key signed the message
Verify = Callable[[PeerId, bytes, bytes], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSignature(WireRecord):
    """Who signed the plan an announcement carries, and the signature (hex)."""

    signer: PeerId
    signature: str

    def __post_init__(self) -> None:
        if not 0 < len(self.signer) <= MAX_PEER_ID_CHARS:
            raise ValueError("bad signer")
        if not 0 < len(self.signature) <= MAX_SIGNATURE_HEX:
            raise ValueError("bad signature length")
        bytes.fromhex(self.signature)  # ValueError if not hex

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.signature)


@dataclass(frozen=True, slots=True)
class Offer:
    """A plan as one member announced it (its own, or relayed)."""

    plan: Plan
    signature: PlanSignature | None
    relayed_by: PeerId


def plan_message(plan: Plan) -> bytes:
    """The bytes a coordinator signs for ``plan``: its wire map, canonically encoded.

    Sorted keys and fixed separators, so a plan that crossed the wire (msgpack
    keeps floats and ints exact) gives the same bytes at the receiver.
    """
    body = json.dumps(plan.to_wire(), sort_keys=True, separators=(",", ":"))
    return PLAN_DOMAIN + body.encode()


def plan_refusal(
    offer: Offer,
    *,
    coordinator: PeerId | None,
    current: Plan | None,
    current_signer: PeerId | None,
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    constraints: PlanConstraints,
    verify: Verify,
) -> str:
    """Why ``offer`` must not be followed (``""``: it may be); see the module docstring."""
    plan, signed = offer.plan, offer.signature
    if plan.model_name != model.name:
        return f"a plan for another model ({plan.model_name[:64]!r})"
    if signed is None:
        return "an unsigned plan"
    if signed.signer != coordinator:
        return f"a plan signed by {signed.signer[-8:]}, not by the coordinator"
    if plan.epoch > MAX_EPOCH or plan.term > MAX_EPOCH:
        return f"epoch {plan.epoch} or term {plan.term} beyond the limit {MAX_EPOCH}"
    if current is not None and plan.term < current.term:
        return f"a plan of term {plan.term}, before the term {current.term} followed"
    if (
        current is not None
        and current_signer == coordinator
        and plan.epoch > current.epoch + EPOCH_WINDOW
    ):
        return f"epoch {plan.epoch} jumps more than {EPOCH_WINDOW} past {current.epoch}"
    if not verify(signed.signer, plan_message(plan), signed.raw):
        return "a forged signature"
    return insane(plan, devices=devices, model=model, constraints=constraints)


def insane(
    plan: Plan,
    *,
    devices: Sequence[DeviceProfile],
    model: ModelProfile,
    constraints: PlanConstraints,
) -> str:
    """Why ``plan`` cannot be served on ``devices`` (the live members' announced devices,
    as the receiver sees them; ``""``: it can)."""
    by_key = {device_key(d.peer_id, d.device): d for d in devices}
    held: dict[str, set[tuple[int, int]]] = {}
    for pipeline in plan.pipelines:
        if pipeline.num_units != model.num_units:
            return f"a pipeline covers {pipeline.num_units} of {model.num_units} units"
        for stage in pipeline.stages:
            if stage.key not in by_key:
                return f"device {stage.key[-24:]} is not announced by a live member"
            held.setdefault(stage.key, set()).add((stage.start, stage.end))
    for key, ranges in sorted(held.items()):
        ordered = sorted(ranges)
        for (_, end), (start, _) in itertools.pairwise(ordered):
            if start < end:
                return f"device {key[-24:]} holds overlapping unit ranges"
        device = by_key[key]
        weights = constraints.weights_for(device.peer_id, device.device)
        per_unit: Sequence[int] = (
            weights.param_bytes if weights is not None else [u.param_bytes for u in model.units]
        )
        need = sum(sum(per_unit[a:b]) for a, b in ordered)
        if need > device.memory_total_bytes:
            return (
                f"device {key[-24:]} would hold {need} weight bytes,"
                f" over the {device.memory_total_bytes} it announced"
            )
    return unmeasured_majority(plan, model=model, constraints=constraints)


def unmeasured_majority(plan: Plan, *, model: ModelProfile, constraints: PlanConstraints) -> str:
    """Why ``plan`` rests on one member's word (``""``: it does not): a pipeline places
    more than half the model's units on one peer's devices whose block step nobody
    measured, while some device's is measured (so the claims are not all alike).

    A member that claims a speed it never showed (no calibration announced, no served
    steps yet) cannot get most of the model by it; a mesh where nobody measured
    anything plans on claims alone, as before."""
    measured = constraints.block_step_s_by_device
    if not measured:
        return ""
    for pipeline in plan.pipelines:
        units: dict[PeerId, int] = {}
        for stage in pipeline.stages:
            if stage.key not in measured:
                units[stage.peer_id] = units.get(stage.peer_id, 0) + stage.end - stage.start
        for peer, count in sorted(units.items()):
            if 2 * count > model.num_units:
                return f"{count} of {model.num_units} units on the unmeasured claims of {peer[-8:]}"
    return ""


def epoch_floor(offers: Sequence[Offer], verify: Verify) -> int:
    """The highest epoch of an announced plan its signer signed, up to :data:`MAX_FLOOR`
    (-1: none): a coordinator with no plan of its own numbers its first one above it,
    so epochs keep rising. An unsigned or forged plan moves nothing, and no floor
    leaves a coordinator fewer than :data:`FLOOR_HEADROOM` epochs to number its plans."""
    for offer in sorted(offers, key=lambda o: o.plan.epoch, reverse=True):
        signed = offer.signature
        if offer.plan.epoch > MAX_FLOOR or signed is None:
            continue
        if verify(signed.signer, plan_message(offer.plan), signed.raw):
            return offer.plan.epoch
    return -1


def term_floor(offers: Sequence[Offer], verify: Verify) -> int:
    """The highest term of an announced plan its signer signed, up to :data:`MAX_FLOOR`
    (-1: none): a coordinator taking over numbers its term above it, and one whose
    term is below it starts a new term, so no member refuses its plans as old.
    Unsigned or forged plans move nothing, as for :func:`epoch_floor`."""
    for offer in sorted(offers, key=lambda o: o.plan.term, reverse=True):
        signed = offer.signature
        if offer.plan.term > MAX_FLOOR or signed is None:
            continue
        if verify(signed.signer, plan_message(offer.plan), signed.raw):
            return offer.plan.term
    return -1


__all__ = [
    "EPOCH_WINDOW",
    "FLOOR_HEADROOM",
    "MAX_EPOCH",
    "MAX_FLOOR",
    "Offer",
    "PlanSignature",
    "Verify",
    "epoch_floor",
    "insane",
    "plan_message",
    "plan_refusal",
    "term_floor",
    "unmeasured_majority",
]
