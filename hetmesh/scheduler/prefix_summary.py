"""What a stage announces of its prefix cache: a bounded set of truncated block hashes.

A stage's prefix cache names each full KV block by the chained hash of the
tokens up to its end (:func:`~hetmesh.partition.prefix.block_hashes`). For
routing, a stage announces up to :data:`SUMMARY_BLOCKS` of those hashes (the
blocks its sessions hold first, then the idle ones most recently used),
each cut to its low 32 bits, as one hex string: at most 4 KiB per stage
whatever the pool's size.

The summary is a hint, never trusted for correctness: a truncated hash that
collides, a stale summary, or a member announcing blocks it does not hold
only sends a request where its prefill is not skipped after all (each stage
answers at open how many tokens it really holds). Because the hashes are
chained, a match is counted as the leading run of a request's hashes found
(:func:`matched_blocks`): one stray hit past a miss counts for nothing.

What is announced is no prompt's hash (issue 45, item 8): each name is a
32-bit keyed hash (:func:`salted`) under a mesh-private key derived from the
mesh secret (:func:`summary_salt`), of a block's name in the stage's cache,
itself scoped to the gateway whose sessions computed it
(:func:`~hetmesh.partition.prefix.scoped`). A gateway matches its own
request's names the same way (``salted(scoped(hashes, gateway), salt)``); whoever reads a record or
a status without the secret cannot tell which prompt a summary holds, and
outside the node only counts are shown.

Pure: no I/O, no trio, no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

SUMMARY_BLOCKS = 512  # hashes a stage announces at most (8,192 tokens of blocks of 16)
_HEX_DIGITS = 8  # 32 bits per hash
_MASK = (1 << 32) - 1


def truncate(block_hash: int) -> int:
    """The part of a block hash a summary keeps."""
    return block_hash & _MASK


def summary_salt(psk: str) -> bytes:
    """The mesh-private key of announced names, from the private-network key (itself
    derived from the mesh secret: ``discovery.host.derive_psk``)."""
    return hashlib.sha256(b"hetmesh/prefix-summary/v1\x00" + psk.encode()).digest()


def salted(names: Iterable[int], salt: bytes) -> list[int]:
    """The 32-bit names announced for a cache's block ``names`` under ``salt``."""
    return [
        int.from_bytes(
            hashlib.blake2b(
                (int(n) & ((1 << 64) - 1)).to_bytes(8, "big"), key=salt, digest_size=4
            ).digest(),
            "big",
        )
        for n in names
    ]


def encode_summary(hashes: Iterable[int], limit: int = SUMMARY_BLOCKS) -> str:
    """The first ``limit`` distinct ``hashes``, truncated, as one hex string (sorted, so
    equal caches announce equal strings)."""
    kept: set[int] = set()
    for h in hashes:
        if len(kept) >= limit:
            break
        kept.add(truncate(h))
    return "".join(f"{h:08x}" for h in sorted(kept))


def decode_summary(value: object, limit: int = SUMMARY_BLOCKS) -> frozenset[int]:
    """The truncated hashes of an announced summary; empty for anything ill-formed or
    over ``limit`` hashes (what members announce may be anything)."""
    if not isinstance(value, str) or len(value) % _HEX_DIGITS or len(value) > limit * _HEX_DIGITS:
        return frozenset()
    try:
        return frozenset(
            int(value[i : i + _HEX_DIGITS], 16) for i in range(0, len(value), _HEX_DIGITS)
        )
    except ValueError:  # not hex
        return frozenset()


def matched_blocks(hashes: Sequence[int], summary: frozenset[int]) -> int:
    """How many leading blocks of a request (its chained ``hashes``) ``summary`` holds."""
    count = 0
    for h in hashes:
        if truncate(h) not in summary:
            break
        count += 1
    return count


__all__ = [
    "SUMMARY_BLOCKS",
    "decode_summary",
    "encode_summary",
    "matched_blocks",
    "salted",
    "summary_salt",
    "truncate",
]
