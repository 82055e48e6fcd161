"""bench/bigmodel.py's pure helpers: which file bytes a stage reads, and the key ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bigmodel.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_bigmodel", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bigmodel = _bench()


def test_unit_prefixes_follow_the_profiles_units() -> None:
    # 4 layers: unit 0 embedding, 1..4 layers 0..3, 5 norm + head
    assert bigmodel.unit_prefixes(0, 2, 4) == ("model.embed_tokens.", "model.layers.0.")
    assert bigmodel.unit_prefixes(2, 4, 4) == ("model.layers.1.", "model.layers.2.")
    assert bigmodel.unit_prefixes(4, 6, 4) == ("model.layers.3.", "model.norm.", "lm_head.")
    assert bigmodel.unit_prefixes(0, 6, 4)[-2:] == ("model.norm.", "lm_head.")


def test_a_tied_head_reads_the_embedding() -> None:
    assert bigmodel.unit_prefixes(5, 6, 4, tied=True) == (
        "model.norm.",
        "lm_head.",
        "model.embed_tokens.",
    )
    assert bigmodel.unit_prefixes(0, 6, 4, tied=True).count("model.embed_tokens.") == 1


def test_unit_prefixes_do_not_confuse_layer_1_with_layer_10() -> None:
    header = {
        "model.layers.1.w": {"data_offsets": [0, 10]},
        "model.layers.10.w": {"data_offsets": [10, 30]},
    }
    spans = bigmodel.stage_spans(header, 100, bigmodel.unit_prefixes(2, 3, 12))
    assert spans == [(100, 10)]


def test_stage_spans_merge_adjacent_tensors_and_skip_metadata() -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "model.layers.0.a": {"data_offsets": [0, 8]},
        "model.layers.0.b": {"data_offsets": [8, 20]},
        "model.layers.1.a": {"data_offsets": [20, 30]},
        "model.layers.0.c": {"data_offsets": [40, 44]},
    }
    spans = bigmodel.stage_spans(header, 1000, ("model.layers.0.",))
    assert spans == [(1000, 20), (1040, 4)]


def test_ratio_max_takes_the_worst_host() -> None:
    assert bigmodel.ratio_max([(1.0, 2.0), (3.0, 2.0)]) == 1.5
    with pytest.raises(ValueError, match="empty"):
        bigmodel.ratio_max([])
