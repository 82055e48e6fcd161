"""Prefix cache of a stage's KV pool: full blocks found again by the tokens they hold.

A full block's keys and values depend only on the tokens up to its end, so
it is named by a *chained* hash: block ``i`` hashes block ``i - 1``'s hash
together with its own 16 token ids (:func:`block_hashes`). Two prompts that
start alike get the same leading hashes, and a session whose prompt starts
with blocks another session already computed attaches those blocks to its
table instead of recomputing them.

:class:`PrefixCache` only counts, as :class:`~hetmesh.partition.blocks.BlockAllocator`
does: which block holds which hash, how many sessions hold each cached
block, and an LRU of cached blocks no session holds. Those idle blocks stay
out of the allocator's free list but count as free: the pool evicts the
least recently used when it runs short (:class:`~hetmesh.partition.kv.KVPool`).
A cached block is never written again — sessions only append after their
last full block — so sharing needs no copy.

Whose blocks are shared with whom (issue 45): a stage cannot tell whether
the tokens a gateway names by ``prefix_hashes`` are the tokens it was fed (a
later stage never sees tokens at all), so a cached block is found only by
sessions of the gateway whose session computed it. :class:`SessionKV
<hetmesh.partition.kv.SessionKV>` names its blocks by :func:`scoped` names of
its gateway's hashes: a gateway naming its blocks with another prompt's
hashes poisons only its own sessions. KV that came whole from another peer (a
migration) is never named at all.

Pure and single-threaded (the stage server's trio thread); tested with
plain tables in ``tests/unit/partition/test_prefix.py``.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from hetmesh.partition.blocks import BLOCK_TOKENS

_MASK = (1 << 64) - 1


def block_hashes(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """The chained hash of every full block of ``token_ids`` (a partial tail has none).

    Deterministic across processes (blake2b, not Python's ``hash``) and
    below 2**63, so it travels as a plain msgpack integer.
    """
    hashes: list[int] = []
    previous = b""
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start : start + block_tokens]
        packed = struct.pack(f"<{block_tokens}Q", *(int(t) & _MASK for t in block))
        previous = hashlib.blake2b(previous + packed, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big") >> 1)
    return hashes


def scoped(hashes: Sequence[int], scope: str) -> list[int]:
    """The names ``hashes`` take in a stage's cache for the sessions of ``scope`` (their
    gateway's peer id): equal hashes of two scopes never name the same block.

    Below 2**63 (blake2b of the scope and the hash), so they travel and announce as
    the hashes themselves do.
    """
    key = hashlib.blake2b(scope.encode(), digest_size=32).digest()
    return [
        int.from_bytes(
            hashlib.blake2b((int(h) & _MASK).to_bytes(8, "big"), key=key, digest_size=8).digest(),
            "big",
        )
        >> 1
        for h in hashes
    ]


class PrefixCache:
    """Which pool blocks hold which prefix hash; see the module docstring."""

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}  # hash -> block
        self._hash_of: dict[int, int] = {}  # block -> hash
        self._refs: dict[int, int] = {}  # cached block -> sessions holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # held by none, oldest first
        self.queried_blocks = 0  # blocks looked up by new sessions
        self.hit_blocks = 0  # of those, found

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a known prefix (held by sessions or idle)."""
        return len(self._hash_of)

    @property
    def idle_blocks(self) -> int:
        """Cached blocks no session holds: reusable by a new prompt, or evictable."""
        return len(self._idle)

    def holds(self, block: int) -> bool:
        return block in self._hash_of

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to ``limit`` cached hashes, those sessions hold first, then the idle ones
        most recently used first (what a stage announces for cache-aware routing)."""
        held = [h for b, h in self._hash_of.items() if self._refs[b] > 0]
        idle = [self._hash_of[b] for b in reversed(self._idle)]
        return (held + idle)[: max(0, limit)]

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached run of ``hashes``, each now held once more."""
        blocks: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self._refs[block] += 1
            self._idle.pop(block, None)
        self.queried_blocks += len(hashes)
        self.hit_blocks += len(blocks)
        return blocks

    def insert(self, block: int, block_hash: int) -> bool:
        """Name ``block`` (full, held by its writer) by ``block_hash``.

        False when that hash is cached already (in another block) or the
        block has a name: it then stays its writer's private block.
        """
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._refs[block] = 1
        return True

    def release(self, block: int) -> bool:
        """A session lets ``block`` go; True when the cache keeps it (do not free it)."""
        if block not in self._hash_of:
            return False
        refs = self._refs[block] - 1
        if refs < 0:
            raise ValueError(f"block {block} is not held")
        self._refs[block] = refs
        if refs == 0:
            self._idle[block] = None  # newest at the end
        return True

    def evict(self, count: int) -> list[int]:
        """Forget up to ``count`` idle blocks, least recently used first; the caller frees them."""
        evicted: list[int] = []
        while self._idle and len(evicted) < count:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            del self._refs[block]
            evicted.append(block)
        return evicted


__all__ = ["PrefixCache", "block_hashes", "scoped"]
