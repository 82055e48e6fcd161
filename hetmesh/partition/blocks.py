"""Block accounting for a paged KV pool: which fixed-size blocks are free.

A stage's KV pool is cut into blocks of :data:`BLOCK_TOKENS` token slots; a
session holds a list of block ids (its block table) and gets more as its
tokens arrive. This module only counts: it never touches tensors, so it is
tested with plain tables (``tests/unit/partition/test_blocks.py``).

Allocation prefers contiguous runs: a session that grows takes the block
right after its last one when that is free, and a new session takes the
first run long enough for it. A contiguous block table lets attention read
the session's keys and values as a view of the pool instead of gathering
them (see :mod:`hetmesh.partition.kv`).
"""

from __future__ import annotations

BLOCK_TOKENS = 16


def blocks_for(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks needed to hold ``tokens`` token slots."""
    return -(-max(0, tokens) // block_tokens)


def is_run(blocks: list[int]) -> bool:
    """Whether ``blocks`` are consecutive ids (their slots are one contiguous range)."""
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


class BlockAllocator:
    """Free/used state of ``num_blocks`` blocks; not thread-safe (one owner thread)."""

    def __init__(self, num_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if num_blocks < 0 or block_tokens < 1:
            raise ValueError("num_blocks must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self._used = bytearray(num_blocks)  # 1 where a block is held
        self._free = num_blocks

    @property
    def num_blocks(self) -> int:
        return len(self._used)

    @property
    def free_blocks(self) -> int:
        return self._free

    def allocate(self, count: int, *, after: int | None = None) -> list[int] | None:
        """``count`` blocks, or None (nothing taken) when fewer are free.

        With ``after`` (the caller's last block) the blocks right after it are
        taken when all free, so the caller's table stays one run.
        """
        if count < 0:
            raise ValueError("count must be >= 0")
        if count > self._free:
            return None
        if count == 0:
            return []
        start = self._run_start(count, after)
        if start is not None:
            chosen = list(range(start, start + count))
        else:  # fragmented: the lowest free blocks
            chosen = [i for i, used in enumerate(self._used) if not used][:count]
        for block in chosen:
            self._used[block] = 1
        self._free -= count
        return chosen

    def free(self, blocks: list[int]) -> None:
        """Return ``blocks``; freeing a block that is not held is a bug (ValueError)."""
        for block in blocks:
            if not 0 <= block < len(self._used) or not self._used[block]:
                raise ValueError(f"block {block} is not held")
            self._used[block] = 0
        self._free += len(blocks)

    def grow(self, extra: int) -> None:
        """Add ``extra`` free blocks at the end (a private pool growing)."""
        self._used.extend(bytes(extra))
        self._free += extra

    def _run_start(self, count: int, after: int | None) -> int | None:
        used = self._used
        if after is not None:
            nxt = after + 1
            if nxt + count <= len(used) and not any(used[nxt : nxt + count]):
                return nxt
        run = 0
        for i, taken in enumerate(used):
            run = 0 if taken else run + 1
            if run == count:
                return i - count + 1
        return None


__all__ = ["BLOCK_TOKENS", "BlockAllocator", "blocks_for", "is_run"]
