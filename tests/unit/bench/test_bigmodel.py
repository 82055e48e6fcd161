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


def test_start_phases_split_a_hosts_start_by_its_log() -> None:
    import time

    log = "\n".join(
        [
            "2026-12-06 00:30:10,619 INFO hetmesh.discovery.service: joining the mesh",
            "2026-12-06 00:30:13,600 INFO hetmesh.node.daemon: profiled: 128.3 GFLOP/s",
            "2026-12-06 00:30:24,126 INFO hetmesh.node.stage_host: loading units [11, 23) of m",
            "2026-12-06 00:30:30,000 INFO hetmesh.node.stage_host: loading units [0, 11) of m",
            "2026-12-06 00:31:16,448 INFO hetmesh.node.stage_host: stage [0, 11) ready: 5 in 1 s",
        ]
    )
    started = time.mktime(time.strptime("2026-12-06 00:30:05", "%Y-%m-%d %H:%M:%S"))
    phases = bigmodel.start_phases(log, started + 0.5, 0, 11)
    assert phases == {
        "imports_s": 5.12,
        "up_profile_s": 2.98,
        "wait_plan_s": 16.4,
        "load_s": 46.45,
    }
    # a stage that never loaded: its phases stop where the log does
    assert bigmodel.start_phases(log, started + 0.5, 23, 34) == {
        "imports_s": 5.12,
        "up_profile_s": 2.98,
    }


def test_log_stamp_finds_the_first_matching_line() -> None:
    import time

    log = "\n".join(
        [
            "2026-12-06 00:30:10,619 INFO hetmesh.node.stage_host: stage [0, 11) ready: 5",
            "2026-12-06 00:30:12,001 INFO hetmesh.node.stage_host: stage [0, 11) ready: 5",
        ]
    )
    base = time.mktime(time.strptime("2026-12-06 00:30:10", "%Y-%m-%d %H:%M:%S"))
    assert bigmodel.log_stamp(log, "stage [0, 11) ready") == pytest.approx(base + 0.619)
    assert bigmodel.log_stamp(log, "stage [11, 23) ready") is None


def test_listening_addr_reads_the_nodes_first_address() -> None:
    log = (
        "2026-12-06 03:05:10,729 INFO hetmesh.discovery.service: joining the mesh\n"
        "2026-12-06 03:05:10,729 INFO hetmesh.node.daemon: listening on "
        "/ip4/10.237.43.2/tcp/4001/p2p/12D3KooWMXq\n"
        "2026-12-06 03:05:10,730 INFO hetmesh.node.daemon: listening on /ip4/1.2.3.4/tcp/1/p2p/X\n"
    )
    assert bigmodel.listening_addr(log) == "/ip4/10.237.43.2/tcp/4001/p2p/12D3KooWMXq"
    assert bigmodel.listening_addr(log.splitlines()[0]) is None


def test_reading_stages_together_reads_every_span(tmp_path: Path) -> None:
    file = tmp_path / "w.bin"
    file.write_bytes(bytes(range(256)) * 64)
    assert bigmodel.read_cold_together(file, [[(0, 4096)], [(4096, 8192), (12288, 4096)]]) >= 0
    with pytest.raises(OSError, match="short read"):
        bigmodel.read_cold_together(file, [[(0, 10)], [(16000, 1000)]])
