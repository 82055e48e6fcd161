"""The serving announcement: one writer, one bounds-checked, lenient reader."""

from __future__ import annotations

from typing import Any

import pytest

from hetmesh.partition.profile import llama_like_config, model_profile
from hetmesh.resources import DeviceProfile
from hetmesh.scheduler import plan
from hetmesh.scheduler.announcement import (
    MAX_VERDICT_CHARS,
    Calibration,
    Host,
    ServedStage,
    ServingAnnouncement,
    read_serving,
    serving_extra,
    serving_stages,
)
from hetmesh.scheduler.replan import announced_plans

MODEL = model_profile(
    llama_like_config(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=256,
    ),
    dtype="float32",
    name="toy",
)
CPU = DeviceProfile(
    peer_id="a",
    device="cpu",
    backend="cpu",
    name="a",
    memory_total_bytes=1 << 32,
    memory_free_bytes=1 << 32,
    matmul_flops=1e10,
    memory_bandwidth_bps=1e10,
)
PLAN = plan([CPU], [], MODEL, epoch=2)
FULL = ServingAnnouncement(
    model="toy",
    weights="int8",
    calibration=Calibration(
        model="toy",
        device="cpu",
        block_step_s=2e-3,
        context_tokens=128,
        weights="int8",
        prefill_chunk_cost=1.1,
        row_cost=0.2,
    ),
    host=Host(key="ab12", cores=2.0, share=1.0),
    plan=PLAN,
    insufficient="",
    stages=(ServedStage(model="toy", start=0, end=4, ready=True),),
    gateway={"tokens_out": 7, "recoveries": 1},
    stage_servers=({"start": 0, "end": 4, "batches": 3},),
)

CAL = serving_extra(FULL)["calibration"]
OK = ServedStage(model="toy", start=0, end=4, ready=True)


def test_serving_announcement_round_trips_through_extra_and_stages() -> None:
    extra, stages = serving_extra(FULL), serving_stages(FULL)
    assert read_serving(extra, stages) == FULL
    assert read_serving(extra, stages, plan_of=None) == ServingAnnouncement(
        **{**{f: getattr(FULL, f) for f in FULL.__dataclass_fields__}, "plan": None}
    )
    # a cleared entry is written too, so it replaces what a peer heard before
    assert serving_extra(ServingAnnouncement())["insufficient"] == ""
    assert read_serving(serving_extra(ServingAnnouncement())) == ServingAnnouncement()


@pytest.mark.parametrize(
    ("entry", "value", "field", "empty"),
    [
        ("model", 5, "model", ""),
        ("model", "m" * 10_000, "model", ""),
        ("weights", ["int8"], "weights", ""),
        (
            "calibration",
            {"model": "toy", "device": "cpu", "block_step_s": "fast"},
            "calibration",
            None,
        ),
        ("calibration", {**CAL, "block_step_s": 0.0}, "calibration", None),
        (
            "calibration",
            {**FULL.calibration.to_wire(), "block_step_s": float("nan")},
            "calibration",
            None,
        ),  # type: ignore[union-attr]
        ("plan", {"epoch": -1}, "plan", None),
        ("plan", "not a map", "plan", None),
        ("insufficient", "x" * (MAX_VERDICT_CHARS + 1), "insufficient", ""),
        (
            "gateway",
            {"tokens_out": True, "recoveries": 1, "x": float("inf")},
            "gateway",
            {"recoveries": 1},
        ),
        ("gateway", {str(i): i for i in range(1000)}, "gateway", {}),
        ("stage_servers", "nope", "stage_servers", ()),
    ],
)
def test_read_serving_drops_only_the_bad_entry(
    entry: str, value: Any, field: str, empty: Any
) -> None:
    extra = {**serving_extra(FULL), entry: value}
    got = read_serving(extra, serving_stages(FULL))
    assert getattr(got, field) == empty
    others = [f for f in FULL.__dataclass_fields__ if f != field]
    assert all(getattr(got, f) == getattr(FULL, f) for f in others)


def test_read_serving_skips_bad_stages_and_other_versions() -> None:
    stages = [
        {"model": "toy", "start": 0, "end": 4, "ready": True},
        {"model": "toy", "start": 4, "end": 4, "ready": True},  # empty range
        {"model": "toy", "start": "0", "end": 4, "ready": True},
        {"start": 0, "end": 4},
        "junk",
    ]
    assert read_serving({}, stages).stages == (
        ServedStage(model="toy", start=0, end=4, ready=True),
    )
    assert read_serving(None).model == ""
    assert read_serving({**serving_extra(FULL), "serving_version": 2}) == ServingAnnouncement()
    # no version key reads as this version
    unversioned = {k: v for k, v in serving_extra(FULL).items() if k != "serving_version"}
    assert read_serving(unversioned).model == "toy"


def test_announced_plans_reads_through_the_one_reader() -> None:
    extras = [serving_extra(FULL), {"plan": {"epoch": "x"}}, None, {}]
    assert announced_plans(extras) == [PLAN]


@pytest.mark.parametrize(
    "block_step_s",
    [1e-30, 5e-324, 1e9, float("inf"), float("-inf")],
)
def test_read_serving_refuses_a_calibration_no_device_measures(block_step_s: float) -> None:
    calibration = {**serving_extra(FULL)["calibration"], "block_step_s": block_step_s}
    assert read_serving({**serving_extra(FULL), "calibration": calibration}).calibration is None


@pytest.mark.parametrize("cost", [-0.5, float("nan"), float("inf"), 1e6, "cheap"])
def test_read_serving_refuses_a_chunk_cost_out_of_bounds(cost: Any) -> None:
    calibration = {**serving_extra(FULL)["calibration"], "prefill_chunk_cost": cost}
    assert read_serving({**serving_extra(FULL), "calibration": calibration}).calibration is None


def test_a_calibration_without_a_chunk_cost_reads_as_not_measured() -> None:
    calibration = {k: v for k, v in CAL.items() if k != "prefill_chunk_cost"}
    read = read_serving({**serving_extra(FULL), "calibration": calibration}).calibration
    assert read is not None
    assert read.prefill_chunk_cost == 0.0  # an older peer's: not measured


@pytest.mark.parametrize("cost", [-0.1, 1.5, float("nan"), float("inf"), "cheap"])
def test_read_serving_refuses_a_row_cost_out_of_bounds(cost: Any) -> None:
    calibration = {**CAL, "row_cost": cost}
    assert read_serving({**serving_extra(FULL), "calibration": calibration}).calibration is None


def test_a_calibration_without_a_row_cost_reads_as_linear() -> None:
    calibration = {k: v for k, v in CAL.items() if k != "row_cost"}
    read = read_serving({**serving_extra(FULL), "calibration": calibration}).calibration
    assert read is not None
    assert read.row_cost == 1.0  # an older peer's: every row a step of its own


@pytest.mark.parametrize(
    "host",
    [
        {"key": "", "cores": 2.0, "share": 1.0},
        {"key": "k" * 65, "cores": 2.0, "share": 1.0},
        {"key": "k", "cores": 0.0, "share": 1.0},
        {"key": "k", "cores": float("nan"), "share": 1.0},
        {"key": "k", "cores": 1e9, "share": 1.0},
        {"key": "k", "cores": 2.0, "share": 3.0},  # more than the host has
        {"key": "k", "cores": 2.0, "share": 0.0},
        {"key": "k", "cores": 2.0},
        "k",
    ],
)
def test_read_serving_drops_an_ill_formed_host_alone(host: Any) -> None:
    read = read_serving({**serving_extra(FULL), "host": host})
    assert read.host is None
    assert read.calibration == FULL.calibration  # the rest still counts


def test_read_serving_refuses_absurd_unit_ranges() -> None:
    stages = [
        {"model": "toy", "start": 0, "end": 2**63, "ready": True},
        {"model": "toy", "start": "x", "end": 4, "ready": True},
        {"model": "toy", "start": 2**64, "end": 2**65, "ready": True},
        {"model": "toy", "start": 0, "end": 4, "ready": True},
    ]
    assert read_serving({}, stages).stages == (OK,)
