"""A stage's int4 matrices and int8 tables converted a slice of rows at a time equal
the same tensors converted whole (the loader's memory bound must not change a bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmesh.partition import materialise
from hetmesh.partition.stage import load_stage
from hetmesh.partition.store import resolve_model
from tests.unit.partition.synth_cache import synth_cache

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return synth_cache(tmp_path_factory.mktemp("synth"), default_model_dir)


# Q4_1 blocks kept as they are, and bf16 quantised on load; qwen2's 96-wide MLP ends
# in a partial (padded) block of 64 rows, its 32-row k/v are one padded block
@pytest.mark.parametrize("name", ["synth-tiny-qwen2", "synth-tiny-bf16"])
def test_int4_stage_loaded_in_slices_equals_loaded_whole(
    name: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = resolve_model(name, cache_dir=cache)
    units = load_stage(folder, 0, 2, weights="int4").profile.num_units
    monkeypatch.setattr(materialise, "INT4_CHUNK_WEIGHTS", 1 << 30)  # one slice a matrix
    monkeypatch.setattr(materialise, "TABLE_CHUNK_WEIGHTS", 1 << 30)
    whole = load_stage(folder, 0, units, weights="int4").state_dict()
    monkeypatch.setattr(materialise, "INT4_CHUNK_WEIGHTS", 1)  # 64 rows a slice
    monkeypatch.setattr(materialise, "TABLE_CHUNK_WEIGHTS", 64 * 1000)  # 1,000 rows
    sliced = load_stage(folder, 0, units, weights="int4").state_dict()
    assert sliced.keys() == whole.keys()
    assert any(k.endswith("weight_packed") for k in whole)
    assert any(k.endswith("weight_q") for k in whole)  # an int8 table
    for key, value in whole.items():
        assert torch.equal(sliced[key], value), key


def test_q4_1_matrices_packed_from_their_bytes_equal_torchs_packer(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader packs Q4_1 bytes itself (hetmesh.partition.int4_direct): a stage so
    loaded equals one whose matrices went through torch's packer, padded blocks too."""
    from hetmesh.partition.quant import Int4Linear

    folder = resolve_model("synth-tiny-qwen2", cache_dir=cache)
    units = load_stage(folder, 0, 2, weights="int4").profile.num_units
    monkeypatch.setattr(materialise, "INT4_CHUNK_WEIGHTS", 1)  # 64 rows a slice
    direct = load_stage(folder, 0, units, weights="int4").state_dict()

    def through_torch(self: object, path: str, source: str, rows_n: int, k: int) -> None:
        packed, scales_zeros = Int4Linear.pack(*self.reader.q4_blocks(source))  # type: ignore[attr-defined]
        self.put(f"{path}.weight_packed", packed)  # type: ignore[attr-defined]
        self.put(f"{path}.scales_zeros", scales_zeros)  # type: ignore[attr-defined]

    monkeypatch.setattr(materialise._Loader, "int4_q4_1", through_torch)
    packed = load_stage(folder, 0, units, weights="int4").state_dict()
    assert direct.keys() == packed.keys()
    assert sum(k.endswith("weight_packed") for k in direct) >= 7
    for key, value in packed.items():
        assert torch.equal(direct[key], value), key


def test_a_stage_loads_on_one_thread_whatever_its_thread_ran_before(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node loads in a reused worker thread: the CPU profile left it a two-thread
    team, which spin-waited at every op of a load on a loaded machine (issue 43). The
    loader runs its tensors on LOAD_THREADS and hands the thread back as it was."""
    import threading

    folder = resolve_model("synth-tiny-qwen2", cache_dir=cache)
    during: set[int] = set()
    put = materialise._Loader.put

    def counting(self: materialise._Loader, path: str, value: torch.Tensor) -> None:
        during.add(torch.get_num_threads())
        put(self, path, value)

    monkeypatch.setattr(materialise._Loader, "put", counting)
    after: list[int] = []

    def worker() -> None:
        torch.set_num_threads(2)
        load_stage(folder, 0, 2, weights="int4")
        after.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert during == {materialise.LOAD_THREADS}
    assert after == [2]
