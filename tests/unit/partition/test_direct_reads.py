"""Tensor bytes read past the page cache (O_DIRECT) equal the file's bytes, whatever
their alignment, and a stage loads the same either way (issue 43: the page cache of a
stage's file was charged to the loading node's cgroup)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetmesh.partition import checkpoint
from hetmesh.partition.checkpoint import DIRECT_ALIGN, open_direct, read_direct


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    data = torch.randint(0, 256, (5 * DIRECT_ALIGN + 123,), dtype=torch.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, path.read_bytes()


@pytest.mark.parametrize(
    ("offset", "count"),
    [(0, DIRECT_ALIGN), (1, 10), (DIRECT_ALIGN - 3, DIRECT_ALIGN + 7), (100, 5 * DIRECT_ALIGN)],
)
def test_direct_reads_equal_the_files_bytes(
    blob: tuple[Path, bytes], offset: int, count: int
) -> None:
    path, data = blob
    fd = open_direct(path)
    if fd is None:
        pytest.skip("no O_DIRECT on this file system")
    try:
        got = read_direct(fd, offset, count)
    finally:
        os.close(fd)
    assert got.numpy().tobytes() == data[offset : offset + count]


def test_a_direct_read_past_the_end_of_the_file_is_refused(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    fd = open_direct(path)
    if fd is None:
        pytest.skip("no O_DIRECT on this file system")
    try:
        with pytest.raises(ValueError, match="shorter"):
            read_direct(fd, len(data) - 10, 20)
    finally:
        os.close(fd)


@pytest.mark.model
@pytest.mark.slow
def test_a_stage_read_past_the_page_cache_equals_one_read_through_it(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hetmesh.partition.stage import load_stage

    monkeypatch.setattr(checkpoint, "DIRECT_MIN_BYTES", 1)  # every read direct
    direct = load_stage(default_model_dir, 0, 3, weights="int4").state_dict()
    monkeypatch.setattr(checkpoint, "open_direct", lambda file: None)
    buffered = load_stage(default_model_dir, 0, 3, weights="int4").state_dict()
    assert direct.keys() == buffered.keys()
    for key, value in buffered.items():
        assert torch.equal(direct[key], value), key


def test_a_refused_direct_read_turns_direct_reads_off(
    blob: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that opens O_DIRECT but refuses its reads (EINVAL): the reader
    falls back to buffered reads for the rest of the file."""
    path, _ = blob
    fd = open_direct(path)
    if fd is None:
        pytest.skip("no O_DIRECT on this file system")

    def refuse(fd: int, offset: int, count: int) -> torch.Tensor:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(checkpoint, "read_direct", refuse)
    direct = checkpoint._Direct(fd)
    assert direct.read(0, 1 << 20, torch.uint8) is None
    assert direct.fd is None  # closed, not tried again
