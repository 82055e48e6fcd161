"""How a long prefill is cut into chunks (pure: no trio, no transport).

A gateway sends a long prefill as several frames of one step, so the stages of
a pipeline overlap on it (:mod:`hetmesh.node.gateway`). One process gains
nothing from chunks (a 512-token prefill as 4 x 128 took 1.24x as long in one
process, docs/benchmarks.md): :class:`~hetmesh.partition.generate.LocalPipeline`
prefills whole.
"""

from __future__ import annotations

import os

from hetmesh.errors import InvalidRequest

# a prefill of at least twice this many tokens is cut into chunks of at least this many
PREFILL_CHUNK_TOKENS = 128
PREFILL_CHUNK_ENV = "HETMESH_PREFILL_CHUNK_TOKENS"
# chunks of one prefill at most: a stage queues this many frames of one session
MAX_PREFILL_CHUNKS = 4


def prefill_chunk_default() -> int:
    """The chunk size when the caller does not say: ``HETMESH_PREFILL_CHUNK_TOKENS``
    (0 turns chunking off), else :data:`PREFILL_CHUNK_TOKENS`."""
    text = os.environ.get(PREFILL_CHUNK_ENV, "").strip()
    if not text:
        return PREFILL_CHUNK_TOKENS
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequest(f"{PREFILL_CHUNK_ENV} must be a token count, not {text!r}") from None
    return max(0, value)


def prefill_chunks(
    count: int, chunk_tokens: int, max_chunks: int = MAX_PREFILL_CHUNKS
) -> list[int]:
    """The sizes of the chunks a prefill of ``count`` tokens is cut into, in order.

    As many chunks of at least ``chunk_tokens`` as fit, at most ``max_chunks``,
    as even as can be; one chunk when ``chunk_tokens`` is 0 or the prefill is
    shorter than two chunks.
    """
    pieces = min(max_chunks, count // chunk_tokens) if chunk_tokens > 0 else 1
    if pieces <= 1:
        return [count]
    size, extra = divmod(count, pieces)
    return [size + 1 if i < extra else size for i in range(pieces)]
