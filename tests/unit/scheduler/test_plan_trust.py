"""Which announced plans a node follows: a decision table over announcements' extras.

Each row is an announcement a member makes (its ``extra["plan"]`` and
``extra["plan_signature"]``, as they cross the wire) and the verdict of the
receiver ``b``, whose coordinator is ``a``. Signatures here are a keyed hash
(the pure check only calls the injected verifier; the real ed25519 one is
tested in tests/unit/node/test_plan_signature.py).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from hetmesh.resources import LinkProfile
from hetmesh.scheduler import MeshSnapshot, PlanConstraints, evaluate
from hetmesh.scheduler.announcement import ServingAnnouncement, read_offer, serving_extra
from hetmesh.scheduler.plan_trust import (
    EPOCH_WINDOW,
    MAX_EPOCH,
    PlanSignature,
    epoch_floor,
    plan_message,
    plan_refusal,
)
from hetmesh.scheduler.records import Plan, WeightBytes, device_key
from tests.unit.scheduler.sched_helpers import cpu_device as device
from tests.unit.scheduler.sched_helpers import toy_cpu_model

GIB = 1024**3
MODEL = toy_cpu_model()
UNITS = MODEL.num_units
LIMITS = PlanConstraints(max_context_tokens=128, reserve_bytes=0, reserve_fraction=0.0)


PEERS = ("a", "b", "c")
MESH = MeshSnapshot(
    devices=tuple(device(p) for p in PEERS),
    links=tuple(
        LinkProfile(src=x, dst=y, rtt_s=1e-3, bandwidth_bps=1e9)
        for x in PEERS
        for y in PEERS
        if x != y
    ),
)


def placed(*pipelines: list[tuple[str, int, int]], epoch: int = 5) -> Plan:
    found = evaluate(
        [[(p, "cpu", a, b) for p, a, b in stages] for stages in pipelines],
        MESH.devices,
        MESH.links,
        MODEL,
        constraints=LIMITS,
        epoch=epoch,
    )
    assert found is not None
    return found


HALF = UNITS // 2
SPLIT = placed([("a", 0, HALF), ("b", HALF, UNITS)])
CURRENT = SPLIT.with_epoch(3)


def sign(signer: str, message: bytes) -> str:
    return hashlib.sha256(signer.encode() + b"|" + message).hexdigest()


def verify(signer: str, message: bytes, signature: bytes) -> bool:
    return signature.hex() == sign(signer, message)


def announced(plan: Plan, signer: str | None = "a") -> dict[str, Any]:
    """An announcement's extra for ``plan``, signed by ``signer``, after a msgpack trip."""
    signature = (
        None
        if signer is None
        else PlanSignature(signer=signer, signature=sign(signer, plan_message(plan)))
    )
    extra = serving_extra(ServingAnnouncement(model="toy", plan=plan, plan_signature=signature))
    return msgpack.unpackb(msgpack.packb(extra), raw=False)  # type: ignore[no-any-return]


def edited(extra: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """``extra`` with its plan's wire map changed (the signature left as it was)."""
    out = copy.deepcopy(extra)
    change(out["plan"])
    return out


def stages(wire: dict[str, Any], pipeline: int = 0) -> list[dict[str, Any]]:
    return wire["pipelines"][pipeline]["stages"]  # type: ignore[no-any-return]


def set_stage(pipeline: int, index: int, **fields: object) -> Callable[[dict[str, Any]], None]:
    return lambda wire: stages(wire, pipeline)[index].update(fields)


@dataclass(frozen=True)
class Row:
    name: str
    extra: dict[str, Any]
    verdict: str  # "" to follow it; else a fragment of the reason (or "malformed")
    relayed_by: str = "a"
    current: Plan | None = CURRENT
    current_signer: str | None = "a"
    snapshot: MeshSnapshot = MESH
    constraints: PlanConstraints = LIMITS


TINY = GIB // 4096  # 256 KiB: far below the toy model's weights
WHOLE = placed([("c", 0, UNITS)])
INT4 = WeightBytes(
    weights="int4",
    param_bytes=tuple(u.param_bytes // 7 for u in MODEL.units),
    kv_bytes_per_token=tuple(u.kv_bytes_per_token for u in MODEL.units),
)
# a and b announced a measured block step; c only claims its speed
MEASURED_AB = PlanConstraints(
    block_step_s_by_device={device_key("a", "cpu"): 1e-3, device_key("b", "cpu"): 1e-3}
)

ROWS = [
    Row("the coordinator's own plan", announced(SPLIT), ""),
    Row("the coordinator's plan relayed by another member", announced(SPLIT), "", relayed_by="c"),
    Row("a first plan when none is followed", announced(SPLIT), "", current=None),
    Row(
        "a forged signature (the plan changed after signing)",
        edited(announced(SPLIT), lambda w: w.update(epoch=6)),
        "forged",
    ),
    Row(
        "a signature over another plan",
        {**announced(SPLIT), "plan_signature": announced(WHOLE)["plan_signature"]},
        "forged",
    ),
    Row("an unsigned plan", announced(SPLIT, signer=None), "unsigned"),
    Row(
        "a plan the publisher signed itself",
        announced(SPLIT, signer="c"),
        "not by the coordinator",
        relayed_by="c",
    ),
    Row(
        "a plan signed by a former coordinator, relayed",
        announced(SPLIT, signer="b"),
        "not by the coordinator",
        relayed_by="c",
    ),
    Row(
        "an epoch jump past the window",
        announced(SPLIT.with_epoch(CURRENT.epoch + EPOCH_WINDOW + 1)),
        "jumps",
    ),
    Row(
        "an epoch at the window's edge",
        announced(SPLIT.with_epoch(CURRENT.epoch + EPOCH_WINDOW)),
        "",
    ),
    Row(
        "a new coordinator's epoch is bounded by the limit only",
        announced(SPLIT.with_epoch(CURRENT.epoch + 10 * EPOCH_WINDOW)),
        "",
        current_signer="z",
    ),
    Row(
        "epoch 2**64 - 1", announced(SPLIT.with_epoch(2**64 - 1)), "beyond the limit", current=None
    ),
    Row(
        "an epoch just past the limit",
        announced(SPLIT.with_epoch(MAX_EPOCH + 1)),
        "beyond the limit",
    ),
    Row(
        "overlapping ranges in a pipeline",
        edited(announced(SPLIT), set_stage(0, 0, end=HALF + 1)),
        "malformed",
    ),
    Row(
        "a gap in a pipeline",
        edited(announced(SPLIT), set_stage(0, 1, start=HALF + 1)),
        "malformed",
    ),
    Row(
        "a pipeline that stops short of the last unit",
        announced(Plan.from_wire(edited(announced(SPLIT), set_stage(0, 1, end=UNITS - 1))["plan"])),
        "covers",
    ),
    Row(
        "one device holding overlapping ranges in two pipelines",
        announced(
            placed(
                [("a", 0, HALF), ("b", HALF, UNITS)], [("a", 0, HALF + 1), ("c", HALF + 1, UNITS)]
            )
        ),
        "overlapping",
    ),
    Row(
        "a device no live member announced",
        announced(SPLIT),
        "not announced",
        snapshot=MeshSnapshot(devices=(device("a"), device("c")), links=MESH.links),
    ),
    Row(
        "more weight bytes than the device announced",
        announced(WHOLE),
        "weight bytes",
        snapshot=MeshSnapshot(devices=(device("a"), device("b"), device("c", TINY)), links=()),
    ),
    Row(
        "the same device holding int4 weights fits",
        announced(WHOLE),
        "",
        snapshot=MeshSnapshot(
            devices=(device("a"), device("b"), device("c", MODEL.total_param_bytes // 5)), links=()
        ),
        constraints=PlanConstraints(weights_by_device={device_key("c", "cpu"): INT4}),
    ),
    Row(
        "most of the model on one member's unmeasured claims, others measured",
        announced(placed([("a", 0, 1), ("c", 1, UNITS)])),
        "unmeasured claims",
        constraints=MEASURED_AB,
    ),
    Row(
        "half the model on unmeasured claims is not most of it",
        announced(placed([("c", 0, HALF), ("a", HALF, UNITS)])),
        "",
        constraints=MEASURED_AB,
    ),
    Row(
        "most of the model on a measured member",
        announced(placed([("c", 0, 1), ("a", 1, UNITS)])),
        "",
        constraints=MEASURED_AB,
    ),
    Row(
        "nobody measured: claims alone, as alike",
        announced(placed([("a", 0, 1), ("c", 1, UNITS)])),
        "",
    ),
    Row(
        "a plan for another model",
        edited(announced(SPLIT), lambda w: w.update(model_name="other")),
        "another model",
    ),
]


def verdict(row: Row) -> str:
    offer = read_offer(row.extra, row.relayed_by)
    if offer is None:
        return "malformed"
    return plan_refusal(
        offer,
        coordinator="a",
        current=row.current,
        current_signer=row.current_signer,
        devices=row.snapshot.devices,
        model=MODEL,
        constraints=row.constraints,
        verify=verify,
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_plan_refusal_table(row: Row) -> None:
    found = verdict(row)
    if row.verdict == "":
        assert found == ""
    else:
        assert row.verdict in found, found


def test_plan_message_survives_the_wire() -> None:
    extra = announced(SPLIT)
    offer = read_offer(extra, "b")
    assert offer is not None
    assert offer.plan == SPLIT
    assert plan_message(offer.plan) == plan_message(SPLIT)
    assert plan_message(SPLIT.with_epoch(6)) != plan_message(SPLIT)


def test_epoch_floor_skips_epochs_past_the_limit() -> None:
    offers = [read_offer(announced(SPLIT.with_epoch(e)), "a") for e in (4, 9, MAX_EPOCH, 2**64 - 1)]
    assert epoch_floor([o for o in offers if o is not None], verify) == 9
    assert epoch_floor([], verify) == -1
