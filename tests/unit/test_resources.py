"""Shared records survive the wire, ignore unknown keys and reject bad ones."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile, UnitProfile

DEVICE = DeviceProfile(
    peer_id="12D3KooWpeer",
    device="cuda:0",
    backend="cuda",
    name="NVIDIA H200",
    memory_total_bytes=141 * 2**30,
    memory_free_bytes=139 * 2**30,
    matmul_flops=4.0e14,
    memory_bandwidth_bps=3.0e12,
    cpu_cores_physical=16,
    utilisation=0.25,
)
LINK = LinkProfile(src="a", dst="b", rtt_s=0.0004, bandwidth_bps=1.25e9)
MODEL = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")


@pytest.mark.parametrize("record", [DEVICE, LINK, MODEL], ids=["device", "link", "model"])
def test_round_trip_through_msgpack(record: Any) -> None:
    wire = msgpack.unpackb(msgpack.packb(record.to_wire()))
    again = type(record).from_wire(wire)
    assert again == record
    assert again.to_wire() == record.to_wire()


def test_model_profile_units_come_back_as_records() -> None:
    again = ModelProfile.from_wire(msgpack.unpackb(msgpack.packb(MODEL.to_wire())))
    assert all(isinstance(u, UnitProfile) for u in again.units)
    assert again.total_param_count == 134_515_008


@pytest.mark.parametrize("record", [DEVICE, LINK, MODEL], ids=["device", "link", "model"])
def test_unknown_keys_are_ignored(record: Any) -> None:
    wire = {**record.to_wire(), "added_in_v9": {"nested": [1, 2]}, "x": None}
    assert type(record).from_wire(wire) == record


@pytest.mark.parametrize(
    ("record", "key"),
    [(DEVICE, "memory_free_bytes"), (LINK, "rtt_s"), (MODEL, "units"), (DEVICE, "peer_id")],
)
def test_missing_required_key_is_rejected(record: Any, key: str) -> None:
    wire = record.to_wire()
    del wire[key]
    with pytest.raises(ValueError, match=key):
        type(record).from_wire(wire)


def test_missing_key_with_default_takes_the_default() -> None:
    wire = DEVICE.to_wire()
    del wire["cpu_cores_logical"]
    assert DeviceProfile.from_wire(wire).cpu_cores_logical == 0


@pytest.mark.parametrize(
    ("record", "key", "value"),
    [
        (DEVICE, "memory_free_bytes", "lots"),
        (DEVICE, "memory_free_bytes", True),  # a bool is not an integer here
        (DEVICE, "memory_free_bytes", 1.5),
        (DEVICE, "backend", "tpu"),
        (DEVICE, "matmul_flops", "fast"),
        (DEVICE, "memory_free_bytes", -1),
        (LINK, "bandwidth_bps", None),
        (LINK, "rtt_s", -0.1),
        (MODEL, "units", "none"),
        (MODEL, "units", [{"kind": "embed"}]),
        (MODEL, "tie_word_embeddings", "yes"),
    ],
)
def test_ill_typed_values_are_rejected(record: Any, key: str, value: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011  (the message names the field; checked below)
        type(record).from_wire({**record.to_wire(), key: value})


def test_rejection_names_the_record_and_field() -> None:
    with pytest.raises(ValueError, match=r"DeviceProfile\.memory_free_bytes"):
        DeviceProfile.from_wire({**DEVICE.to_wire(), "memory_free_bytes": "lots"})
    with pytest.raises(ValueError, match="expected a map"):
        LinkProfile.from_wire([1, 2])


def test_numbers_widen_int_to_float() -> None:
    link = LinkProfile.from_wire({**LINK.to_wire(), "bandwidth_bps": 1000})
    assert isinstance(link.bandwidth_bps, float)
    assert link.bandwidth_bps == 1000.0


@pytest.mark.parametrize(
    ("record", "key", "value"),
    [
        (DEVICE, "matmul_flops", float("nan")),
        (DEVICE, "matmul_flops", float("inf")),
        (DEVICE, "matmul_flops", 1e30),  # absurd: attracts the whole model
        (DEVICE, "memory_bandwidth_bps", -1.0),
        (DEVICE, "memory_free_bytes", 2**62),
        (DEVICE, "memory_total_bytes", 2**70),
        (DEVICE, "cpu_cores_logical", 2**40),
        (DEVICE, "utilisation", 7.0),
        (DEVICE, "measured_at_s", float("-inf")),
        (DEVICE, "name", "n" * 10_000),
        (DEVICE, "matmul_flops", 10**400),  # an integer beyond any float
        (LINK, "rtt_s", float("nan")),
        (LINK, "bandwidth_bps", float("inf")),
        (LINK, "bandwidth_bps", 1e20),
        (LINK, "rtt_s", 1e9),
        (LINK, "dst", "p" * 10_000),
    ],
)
def test_out_of_range_values_are_rejected_at_the_wire(record: Any, key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=key.split("_")[0] if key != "dst" else "src or dst"):
        type(record).from_wire({**record.to_wire(), key: value})


def test_bounds_admit_the_largest_real_machines() -> None:
    big = DeviceProfile.from_wire(
        {**DEVICE.to_wire(), "matmul_flops": 2e15, "memory_total_bytes": 2 * 2**40}
    )
    assert big.matmul_flops == 2e15
    assert LinkProfile.from_wire({**LINK.to_wire(), "bandwidth_bps": 5e10}).bandwidth_bps == 5e10
