"""Weight formats: parsing, and the bytes a model profile counts per format."""

from __future__ import annotations

import pytest

from hetmesh.errors import InvalidRequest
from hetmesh.partition.formats import (
    WEIGHT_CHOICES,
    WeightFormat,
    activation_dtype,
    check_supported,
    kv_dtype,
    parse_weights,
)
from hetmesh.partition.profile import KNOWN_SHAPES, model_profile

SMOL = KNOWN_SHAPES["smollm2-135m"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", None),
        (None, None),
        ("float32", WeightFormat.FLOAT32),
        ("BF16", WeightFormat.BFLOAT16),
        (" float16 ", WeightFormat.FLOAT16),
        ("int8", WeightFormat.INT8),
        ("int4", WeightFormat.INT4),
    ],
)
def test_parse_weights_accepts_the_choices(text: str | None, expected: WeightFormat | None) -> None:
    assert parse_weights(text) == expected


def test_parse_weights_rejects_others_naming_the_choices() -> None:
    with pytest.raises(InvalidRequest, match="int4") as info:
        parse_weights("int3")
    assert all(choice in str(info.value) for choice in WEIGHT_CHOICES)


def test_activation_dtype_is_fp32_for_integer_formats() -> None:
    assert activation_dtype(WeightFormat.BFLOAT16) == "bfloat16"
    assert activation_dtype(WeightFormat.INT8) == "float32"
    assert activation_dtype(WeightFormat.INT4) == "float32"


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
def test_float_formats_count_every_parameter_at_the_dtype_width(fmt: str) -> None:
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[fmt]
    profile = model_profile(SMOL, weights=fmt)
    assert profile.dtype == fmt
    for unit in profile.units:
        assert unit.param_bytes == unit.param_count * width
    assert model_profile(SMOL, dtype=fmt) == profile  # the older spelling agrees


def test_integer_formats_count_their_compact_bytes() -> None:
    fp32 = model_profile(SMOL, weights=WeightFormat.FLOAT32)
    int8 = model_profile(SMOL, weights=WeightFormat.INT8)
    int4 = model_profile(SMOL, weights=WeightFormat.INT4)
    assert int8.dtype == int4.dtype == "float32"
    block32, block8, block4 = (p.units[1].param_bytes for p in (fp32, int8, int4))
    # a SmolLM2 layer: 3.54 M linear weights + 1152 norm weights
    linear = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    assert block32 == (linear + 1152) * 4
    scales8 = (576 + 192 + 192 + 576 + 1536 + 1536 + 576) * 4
    assert block8 == linear + scales8 + 1152 * 4
    assert block4 == linear // 2 + (linear // 32) * 4 + 1152 * 4
    ratio8 = int8.total_param_bytes / fp32.total_param_bytes
    ratio4 = int4.total_param_bytes / fp32.total_param_bytes
    assert 0.25 < ratio8 < 0.27
    assert 0.17 < ratio4 < 0.19
    # integer formats cache keys and values in fp16: half of fp32's bytes per token
    assert int8.units[1].kv_bytes_per_token == int4.units[1].kv_bytes_per_token
    assert 2 * int8.units[1].kv_bytes_per_token == fp32.units[1].kv_bytes_per_token == 192 * 2 * 4


def test_the_kv_cache_is_fp16_under_integer_formats_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert [kv_dtype(f) for f in WeightFormat] == [
        "float32",
        "bfloat16",
        "float16",
        "float16",
        "float16",
    ]
    monkeypatch.setenv("HETMESH_KV16", "0")
    assert kv_dtype(WeightFormat.INT4) == kv_dtype(WeightFormat.INT8) == "float32"
    assert model_profile(SMOL, weights="int4").units[1].kv_bytes_per_token == 192 * 2 * 4


def test_model_profile_rejects_both_spellings_and_unknown_formats() -> None:
    with pytest.raises(ValueError, match="not both"):
        model_profile(SMOL, dtype="float32", weights="int8")
    with pytest.raises(ValueError, match="int3"):
        model_profile(SMOL, weights="int3")


def test_check_supported_on_cpu_and_unknown_devices() -> None:
    for fmt in WeightFormat:
        check_supported(fmt, "cpu")
    with pytest.raises(InvalidRequest, match="unknown device"):
        check_supported(WeightFormat.INT8, "tpu")
    with pytest.raises(InvalidRequest, match="mps"):
        check_supported(WeightFormat.INT4, "mps")
