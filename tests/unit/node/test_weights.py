"""A node's weight format: auto's choice, what fits, the bytes the planner charges."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetmesh.node.weights import (
    WEIGHTS_KEY,
    choose_weights,
    fits,
    supported_formats,
    weight_bytes,
    weights_constraints,
)
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import DeviceProfile
from hetmesh.scheduler.records import PlanConstraints

SMOL = KNOWN_SHAPES["smollm2-135m"]


def _device(peer: str, memory: int) -> DeviceProfile:
    return DeviceProfile(
        peer_id=peer,
        device="cpu",
        backend="cpu",
        name=peer,
        memory_total_bytes=memory,
        memory_free_bytes=memory,
        matmul_flops=1e11,
        memory_bandwidth_bps=1e10,
    )


@pytest.mark.parametrize(
    ("steps", "fitting", "chosen"),
    [
        # bf16 measured faster than fp32: it wins; int8 slower: not chosen
        ({"float32": 2.0, "bfloat16": 1.5, "int8": 6.0}, None, "bfloat16"),
        # equal steps: the first of the float order (float32) wins
        ({"float32": 2.0, "bfloat16": 2.0, "int8": 6.0}, None, "float32"),
        # int8 measured faster than the best float: chosen
        ({"float32": 2.0, "bfloat16": 1.8, "int8": 1.0}, None, "int8"),
        # int4 measured fastest of all (its CPU kernel can beat fp32): chosen
        ({"float32": 2.0, "bfloat16": 1.8, "int8": 1.9, "int4": 0.9}, None, "int4"),
        # no float fits: the fastest compact format that does (int4 unmeasured: 10.0)
        ({"float32": 2.0, "bfloat16": 1.5, "int8": 6.0}, {"int8", "int4"}, "int8"),
        # ... int4 faster than int8 (an AVX2 CPU's slow int8): int4, never the slower int8
        ({"float32": 2.0, "bfloat16": 1.5, "int8": 6.0, "int4": 3.0}, {"int8", "int4"}, "int4"),
        # ... equal steps: the most faithful (int8)
        ({"float32": 2.0, "int8": 3.0, "int4": 3.0}, {"int8", "int4"}, "int8"),
        ({"float32": 2.0, "bfloat16": 1.5, "int8": 6.0, "int4": 9.0}, {"int4"}, "int4"),
        # only fp32 would be slower than bf16, but bf16 does not fit here
        ({"float32": 2.0, "bfloat16": 1.5, "int8": 6.0}, {"float32", "int8"}, "float32"),
    ],
)
def test_auto_picks_the_fastest_fitting_float_and_compact_only_when_it_must(
    steps: dict[str, float], fitting: set[str] | None, chosen: str
) -> None:
    timed: list[str] = []

    def measure(w: str) -> float:
        timed.append(w)
        return steps.get(w, 10.0)

    candidates = ["float32", "bfloat16", "int8", "int4"]
    fmt, step = choose_weights(candidates, lambda w: fitting is None or w in fitting, measure)
    assert fmt == chosen
    assert step == steps[chosen]


def test_auto_announces_no_step_when_nothing_was_measured() -> None:
    fmt, step = choose_weights(["float32", "bfloat16"], lambda _w: True, lambda _w: None)
    assert (fmt, step) == ("float32", None)


def test_a_format_fits_a_device_that_holds_one_of_its_units() -> None:
    profile = model_profile(SMOL, name="smol")
    cons = PlanConstraints(max_context_tokens=256, reserve_bytes=0, reserve_fraction=0.0)
    fp32 = weight_bytes(SMOL, "float32", name="smol")
    int8 = weight_bytes(SMOL, "int8", name="smol")
    # the head (49152 × 576 matrix plus its logits workspace) is the largest unit;
    # the embedding alone is 113 MB in fp32 and ~29 MB in int8
    assert fits(profile, fp32, _device("a", 200 << 20), cons)
    # an fp32 block (~14 MB) with its prefill workspace (~9 MB), but no table
    small = _device("a", 30 << 20)
    assert fits(profile, fp32, small, cons)
    tiny = _device("a", 20 << 20)
    assert not fits(profile, fp32, tiny, cons)
    assert fits(profile, int8, tiny, cons)  # an int8 block is ~4 MB
    assert sum(int8.param_bytes) < 0.3 * sum(fp32.param_bytes)


def test_each_peer_is_charged_the_bytes_of_the_format_it_announced() -> None:
    devices = [_device("a", 1 << 30), _device("b", 1 << 30), _device("c", 1 << 30)]
    announced = [("a", {WEIGHTS_KEY: "int8"}), ("b", {WEIGHTS_KEY: "bfloat16"}), ("c", {})]
    known = {w: weight_bytes(SMOL, w, name="smol") for w in ("int8", "bfloat16")}
    cons = weights_constraints(PlanConstraints(), announced, devices, known.get)
    assert set(cons.weights_by_device) == {"a/cpu", "b/cpu"}
    assert cons.weights_by_device["a/cpu"].weights == "int8"
    assert cons.weights_by_device["b/cpu"] == known["bfloat16"]
    # unchanged inputs give the same record back (no replan churn)
    assert weights_constraints(cons, announced, devices, known.get) is cons
    # a format this node does not know is planned on the model's own profile
    unknown = weights_constraints(
        PlanConstraints(), [("a", {WEIGHTS_KEY: "fp7"})], devices, known.get
    )
    assert unknown.weights_by_device == {}


def test_a_cpu_runs_the_float_and_integer_formats_but_not_emulated_fp16() -> None:
    found = supported_formats("cpu")
    assert found[:2] == ["float32", "bfloat16"]
    assert "float16" not in found
    assert "int8" in found


def test_a_stage_holding_an_int_head_is_charged_its_packed_copy() -> None:
    from hetmesh.partition.quant import packed_head_bytes
    from hetmesh.scheduler.cost import CostModel

    int4 = weight_bytes(SMOL, "int4", name="smol")
    pack = packed_head_bytes(int(SMOL["vocab_size"]), int(SMOL["hidden_size"]))
    assert int4.head_pack_bytes == pack > 20 << 20  # 49,152 x 576 int8 rows, packed
    assert weight_bytes(SMOL, "bfloat16", name="smol").head_pack_bytes == 0
    device = _device("a", 8 << 30)
    cons = PlanConstraints(weights_by_device={"a/cpu": int4})
    with_pack = CostModel(model_profile(SMOL, weights="int4"), [device], [], cons)
    without = CostModel(
        model_profile(SMOL, weights="int4"),
        [device],
        [],
        PlanConstraints(weights_by_device={"a/cpu": replace(int4, head_pack_bytes=0)}),
    )
    n = with_pack.n
    head_stage, first_stage = (n - 3, n), (0, 3)
    assert with_pack.stage_memory_bytes(0, *head_stage) == (
        without.stage_memory_bytes(0, *head_stage) + pack
    )
    assert with_pack.stage_memory_bytes(0, *first_stage) == without.stage_memory_bytes(
        0, *first_stage
    )
    # read in the rows' stead: the head's step time is unchanged
    assert with_pack.step_s(0, *head_stage) == without.step_s(0, *head_stage)
