"""bench/weights.py's summary of auto's pick from measured decode speeds (pure helper)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[3] / "bench" / "weights.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_weights", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


weights = _bench()


def _speeds(**tok_s: float) -> dict[str, dict[str, float]]:
    return {fmt: {"decode_tok_s": value} for fmt, value in tok_s.items()}


def test_auto_avoids_an_int8_slower_than_fp32_and_names_the_slow_formats() -> None:
    # an AVX2 CPU's figures: int8 at 0.59x fp32, int4 barely faster than fp32
    got = weights._auto_pick(_speeds(float32=20.0, bfloat16=20.2, int8=11.8, int4=21.1))
    assert got == {
        "auto_pick": "int4",
        "auto_avoids_int8": True,
        "slower_than_fp32_here": ["int8"],
    }


def test_auto_takes_int8_where_it_is_the_fastest() -> None:
    got = weights._auto_pick(_speeds(float32=10.0, int8=12.0))
    assert got == {"auto_pick": "int8", "auto_avoids_int8": False, "slower_than_fp32_here": []}
