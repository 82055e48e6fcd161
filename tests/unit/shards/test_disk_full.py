"""A disk that fills up during a fetch: a clear error, nothing partial left as complete.

A :class:`Shards` fetching the tiny model from one stand-in holder (pure logic:
the holder's answer is the checkpoint's own bytes) into a cache whose file
writes stop with ``ENOSPC`` once a byte budget is spent, part-way through a
tensor. The fetch fails with a ``ModelError`` that says so and names the file;
every tensor file left is whole and verified, no temporary file remains, and
once there is room again the fetch resumes with only the tensors that lack.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from hetmesh.errors import ModelError
from hetmesh.partition.checkpoint import CheckpointReader
from hetmesh.partition.store import SHARD_TENSORS
from hetmesh.shards import cache
from hetmesh.shards.fetch import Shards
from hetmesh.shards.manifest import build_manifest, tensors_for_units
from tests.unit.partition.tiny_models import save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny("llama-tied", folder)
    return folder


class _SmallDisk:
    """``os.fdopen`` for files whose writes all share ``budget`` bytes, then ENOSPC."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self._fdopen = os.fdopen

    def fdopen(self, fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return _Writer(self, self._fdopen(fd, mode, *args, **kwargs))


class _Writer:
    def __init__(self, disk: _SmallDisk, real: Any) -> None:
        self._disk = disk
        self._real = real

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._real.close()

    def write(self, data: bytes) -> int:
        room = min(len(data), self._disk.left)
        self._real.write(data[:room])  # what fits lands on disk, as a real write would
        self._disk.left -= room
        if room < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return room

    def flush(self) -> None:
        self._real.flush()

    def fileno(self) -> int:
        return int(self._real.fileno())


class _OneHolder(Shards):
    def __init__(self, model: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model = model

    def holders(self, unit: int) -> list[str]:
        return ["holder"]

    async def _request(self, peer: str, kind: str, name: str, nbytes: int) -> bytes | None:
        with CheckpointReader(self._model) as reader:
            return reader.stored_bytes(name)


async def test_a_full_disk_fails_the_fetch_clearly_and_leaves_nothing_partial(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = build_manifest(model)
    folder = cache.open_folder(tmp_path, manifest, manifest.id)
    entries = tensors_for_units(manifest, 0, manifest.num_units)
    total = sum(t.nbytes for t in entries)
    shards = _OneHolder(model, None, folder, manifest, partial=True, parallel=1)
    disk = _SmallDisk(total // 2)  # runs out in the middle of some tensor
    monkeypatch.setattr(cache.os, "fdopen", disk.fdopen)

    with pytest.raises(ModelError, match="No space left on device") as caught:
        await shards.ensure(0, manifest.num_units)
    assert f"{SHARD_TENSORS}/" in str(caught.value)  # it names the file it could not write
    assert disk.left == 0

    left = sorted(p.name for p in (folder / SHARD_TENSORS).iterdir())
    assert all(not name.startswith(".") for name in left), left  # no temporary file remains
    stored = [t for t in entries if cache.has_tensor(folder, t)]
    assert 0 < len(stored) < len(entries)
    assert len(left) == len(stored)  # every file there is a whole tensor...
    with CheckpointReader(model) as reader:
        for t in stored:  # ...and the right bytes
            assert cache.tensor_path(folder, t).read_bytes() == reader.stored_bytes(t.name)

    monkeypatch.undo()  # room again: the fetch resumes with what lacks
    resumed = _OneHolder(model, None, folder, manifest, partial=True, parallel=1)
    await resumed.ensure(0, manifest.num_units)
    assert resumed.tensors_fetched == len(entries) - len(stored)
    assert all(cache.has_tensor(folder, t) for t in entries)
