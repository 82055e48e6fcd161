"""How a long prefill is cut into chunks (pure: no trio, no transport).

A gateway sends a long prefill as several frames of one step, so the stages of
a pipeline overlap on it (:mod:`hetmesh.node.gateway`). One process gains
nothing from chunks (a 512-token prefill as 4 x 128 took 1.24x as long in one
process, docs/benchmarks.md): :class:`~hetmesh.partition.generate.LocalPipeline`
prefills whole.

Chunks pay only where a device's prefill is bound by its compute, so that
four chunks cost about what the whole costs. Where it is bound by streaming
the weights (bf16 on a CPU with AMX: four 128-token chunks took 1.74x the
whole 512), each chunk streams them again, and the mesh's time to the first
token grew 1.5x. So each node measures what chunks cost on its device, in its
format (:func:`hetmesh.node.calibration.measure_chunk_cost`), and a gateway
cuts a prefill only for a route whose every stage measured them cheap
(:func:`route_chunk_tokens`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from hetmesh.errors import InvalidRequest

# a prefill of at least twice this many tokens is cut into chunks of at least this many
# (96: a 512-token prompt is cut in five, 64 / 128 / 128 / 128 / 64 tapered, below)
PREFILL_CHUNK_TOKENS = 96
PREFILL_CHUNK_ENV = "HETMESH_PREFILL_CHUNK_TOKENS"
# chunks of one prefill at most: a stage queues this many frames of one session. Five
# tapered chunks beat four in every pair of a quiet A/B (a 512-token prompt through a
# 3-stage int4 cut on two vCPUs, both models; docs/journal/2026-12-15-lead.md): more,
# smaller chunks shorten the fill and the drain, where only one stage works
MAX_PREFILL_CHUNKS = 5
# another cap (a stage then queues as many); more chunks need
# HETMESH_PREFILL_CHUNK_TOKENS small enough too, e.g. 64 for 8 chunks of 512 tokens
MAX_PREFILL_CHUNKS_ENV = "HETMESH_PREFILL_MAX_CHUNKS"
# a route of several stages tapers its chunks (prefill_schedule): the first and the last
# half the others, so the first stage hands the pipeline its first chunk sooner (fill)
# and the last stage's last chunk is shorter (drain); 0 turns it off (even chunks)
PREFILL_TAPER_ENV = "HETMESH_PREFILL_TAPER"
# a route is cut into chunks only if no stage measured them costing more than this many
# times the whole prefill: fp32 measured 1.14 (chunks won, TTFT 0.85x the single
# process against 1.04x whole), int8 0.96 and int4 1.0 on the same CPU; bf16 with AMX
# measured 1.74 (chunks lost, 1.58x against 1.07x whole), docs/benchmarks.md
CHUNK_COST_LIMIT = 1.3


def token_count_env(name: str, default: int) -> int:
    """A token count from the environment variable ``name`` (``default`` when unset);
    ``InvalidRequest`` for anything but an integer."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"{name} must be a token count, not {text!r}") from None


def prefill_chunk_default() -> int:
    """The chunk size when the caller does not say: ``HETMESH_PREFILL_CHUNK_TOKENS``
    (0 turns chunking off), else :data:`PREFILL_CHUNK_TOKENS`."""
    return max(0, token_count_env(PREFILL_CHUNK_ENV, PREFILL_CHUNK_TOKENS))


def max_prefill_chunks() -> int:
    """The most chunks a gateway cuts a prefill into: ``HETMESH_PREFILL_MAX_CHUNKS``
    (at least 1), else :data:`MAX_PREFILL_CHUNKS`; ``InvalidRequest`` if not a count."""
    return max(1, token_count_env(MAX_PREFILL_CHUNKS_ENV, MAX_PREFILL_CHUNKS))


def prefill_chunks(count: int, chunk_tokens: int, max_chunks: int | None = None) -> list[int]:
    """The sizes of the chunks a prefill of ``count`` tokens is cut into, in order.

    As many chunks of at least ``chunk_tokens`` as fit, at most ``max_chunks``
    (None: :func:`max_prefill_chunks`), as even as can be; one chunk when
    ``chunk_tokens`` is 0 or the prefill is shorter than two chunks.
    """
    if max_chunks is None:
        max_chunks = max_prefill_chunks()
    pieces = min(max_chunks, count // chunk_tokens) if chunk_tokens > 0 else 1
    if pieces <= 1:
        return [count]
    size, extra = divmod(count, pieces)
    return [size + 1 if i < extra else size for i in range(pieces)]


def prefill_taper() -> bool:
    """Whether a route of several stages tapers its prefill chunks: on unless
    ``HETMESH_PREFILL_TAPER`` is ``0``."""
    return os.environ.get(PREFILL_TAPER_ENV, "1").strip() != "0"


def prefill_schedule(
    count: int,
    chunk_tokens: int,
    max_chunks: int | None = None,
    *,
    stages: int = 1,
    taper: bool | None = None,
) -> list[int]:
    """The chunks a prefill of ``count`` tokens is sent in, through ``stages`` stages.

    As many chunks as :func:`prefill_chunks` cuts, but on a route of two stages or
    more, of three chunks or more, tapered (``taper``; None: :func:`prefill_taper`):
    the first and the last chunk half the size of the others. While the first chunk
    goes through the first stage the others wait for it, and while the last goes
    through the last stage the others are done: on a host whose cores the stages
    share, those are the prefill's idle cores (the pipeline's fill and drain), and a
    chunk half as long halves them. The chunks in between carry the rest, as even as
    can be; the count stays what a stage queues (``max_chunks``). With the defaults a
    512-token prefill through three stages goes as 64 / 128 / 128 / 128 / 64
    (measured against four chunks at :data:`MAX_PREFILL_CHUNKS`).
    """
    sizes = prefill_chunks(count, chunk_tokens, max_chunks)
    if taper is None:
        taper = prefill_taper()
    pieces = len(sizes)
    if not taper or stages < 2 or pieces < 3:
        return sizes
    # weights 1/2, 1, ..., 1, 1/2: an end is count / (2 (pieces - 1)), to the nearest
    # token (floored, 7 in three would be 1 / 5 / 1), leaving every middle chunk a token
    end = max(1, min(int(count / (2 * (pieces - 1)) + 0.5), (count - pieces + 2) // 2))
    middle, extra = divmod(count - 2 * end, pieces - 2)
    return [end] + [middle + 1 if i < extra else middle for i in range(pieces - 2)] + [end]


def route_chunk_tokens(
    costs: Iterable[float | None], chunk_tokens: int, limit: float = CHUNK_COST_LIMIT
) -> int:
    """``chunk_tokens`` for a route whose stages measured chunk costs ``costs``, or 0.

    A cost is the stages' time for :data:`MAX_PREFILL_CHUNKS` chunks of a
    prefill ÷ its time whole, as measured on that stage's device and format;
    None where it was not measured (a stage that cannot say keeps chunking on).
    Any stage above ``limit`` turns chunking off for the route: each chunk would
    cost it more than the overlap with the other stages gains.
    """
    if any(cost is not None and cost > limit for cost in costs):
        return 0
    return chunk_tokens
