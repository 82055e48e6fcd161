"""The block allocator of a paged KV pool (pure tables, no tensors)."""

from __future__ import annotations

import pytest

from hetmesh.partition.blocks import BlockAllocator, blocks_for, is_run


@pytest.mark.parametrize(
    ("tokens", "blocks"), [(0, 0), (-1, 0), (1, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_blocks_for_rounds_up_to_whole_blocks(tokens, blocks):
    assert blocks_for(tokens) == blocks


@pytest.mark.parametrize(
    ("blocks", "run"),
    [([], True), ([4], True), ([2, 3, 4], True), ([2, 4], False), ([3, 2], False)],
)
def test_is_run(blocks, run):
    assert is_run(blocks) is run


def test_allocator_prefers_runs_then_falls_back_to_any_free_blocks():
    pool = BlockAllocator(8)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1], [2, 3])
    assert pool.allocate(1, after=a[-1]) == [4]  # 2 is taken: the first free run instead
    assert pool.allocate(1, after=b[-1]) == [5]  # the block right after b's last one
    pool.free([2, 3])
    assert pool.allocate(2) == [2, 3]  # the first run long enough
    pool.free([0, 2])
    assert pool.allocate(2) == [6, 7]  # a run exists further on
    assert pool.allocate(2) == [0, 2]  # none left: the lowest free blocks
    assert pool.free_blocks == 0
    assert pool.allocate(1) is None  # full: nothing taken
    assert pool.allocate(0) == []


def test_allocator_refuses_without_taking_anything():
    pool = BlockAllocator(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.free_blocks == 1


def test_allocator_rejects_double_free_and_foreign_blocks():
    pool = BlockAllocator(4)
    held = pool.allocate(2)
    pool.free(held)
    with pytest.raises(ValueError, match="not held"):
        pool.free(held)
    with pytest.raises(ValueError, match="not held"):
        pool.free([9])
    assert pool.free_blocks == 4


def test_allocator_grows_with_free_blocks_at_the_end():
    pool = BlockAllocator(2)
    assert pool.allocate(2) == [0, 1]
    pool.grow(3)
    assert (pool.num_blocks, pool.free_blocks) == (5, 3)
    assert pool.allocate(3, after=1) == [2, 3, 4]


def test_allocator_checks_its_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)
    with pytest.raises(ValueError, match="count"):
        BlockAllocator(2).allocate(-1)
