"""A split prefill: a long prompt's layers cut between two idle peers holding the same units.

A route of one stage (a peer holding the whole model) prefills a prompt alone,
chunk after chunk, while the mesh's other replicas may sit idle. When another
replica of the same units, in the same weight format, is idle, the gateway
borrows it as the prompt's *helper*:

1. it opens the session on the route's stage with ``OpenSession(split=k,
   helper=<helper>)`` and on the helper with ``OpenSession(split=k,
   next_peer=<stage>)``, ``k`` the unit between them (:func:`split_unit`);
2. it sends the prompt's chunks to the helper, which runs units ``[start, k)``
   of each and sends the hidden states on to the stage, which runs units
   ``[k, end)``: while the stage computes chunk 1 the helper computes chunk 2,
   so a prompt of four chunks takes about 5/8 of its time on one peer;
3. after the last chunk the helper sends the stage the KV of its units' layers
   (one :class:`~hetmesh.transport.frames.KVBlock`) and lets the session go;
   the stage samples the first token from the last chunk as usual, holds the
   next step until that KV is in (it is needed from the second token on),
   and then decodes alone with the whole KV, as if it had computed it all.

The outputs are those of the unsplit route: each unit runs the same weights on
the same inputs. Anything failing (the helper gone, a bad frame, KV refused)
fails the step, and the gateway replays the session without that peer.

This module holds the pure parts: the roles, the spans each side runs, where to
cut and which replica may help. It does no I/O.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from hetmesh.node.control import OpenSession
from hetmesh.resources import PeerId

SPLIT_PREFILL_ENV = "HETMESH_SPLIT_PREFILL"


def split_prefill_default() -> bool:
    """Whether gateways split long prefills when the caller does not say:
    ``HETMESH_SPLIT_PREFILL=0`` turns it off (the path before issue 16's split)."""
    return os.environ.get(SPLIT_PREFILL_ENV, "1").strip() not in ("0", "false", "no", "off")


# a helper measured this much slower than the route's stage (or faster) still takes half
# the layers: block timings of like devices differ by noise, and a cut moved by it would
# leave the other side waiting
EVEN_SPEEDS = 1.25
# a helper slower than this many times the route's stage is not worth its hop and KV
SLOWEST_HELPER = 3.0


def split_unit(start: int, end: int, main_s: float = 0.0, helper_s: float = 0.0) -> int:
    """Where to cut units ``[start, end)`` of a whole-model stage between a helper (the
    units before) and the route's stage (from there), given their measured block step
    times (0: unknown): half the layers each for like speeds, else in proportion to
    speed, so both sides take about as long (the embedding costs next to nothing, the
    head runs on one row of the prompt)."""
    half = (start + end) // 2
    if main_s <= 0 or helper_s <= 0 or 1 / EVEN_SPEEDS <= helper_s / main_s <= EVEN_SPEEDS:
        return half
    layers = end - start - 2  # units between the embedding and the head
    share = round(layers * main_s / (main_s + helper_s))
    return start + 1 + min(max(share, 1), layers - 1)


def split_role(request: OpenSession) -> str:
    """A session's part in a split prefill: "helper" (runs the prompt's first units
    for another peer), "main" (runs the rest, and then decodes), or "" (no split)."""
    if not request.split:
        return ""
    return "main" if request.helper else "helper"


def is_helped_chunk(positions: Sequence[int], request: OpenSession) -> bool:
    """Whether an activation of a "main" session is one of its prompt's chunks (they
    come from its helper, as hidden states; its decode steps come from its gateway)."""
    return bool(request.helper) and bool(positions) and positions[-1] < request.prompt_tokens


def span_of(positions: Sequence[int], request: OpenSession) -> tuple[int, int] | None:
    """The units an activation of the session runs through (None: all of the stage's)."""
    role = split_role(request)
    if role == "helper":
        return request.start, request.split
    if role == "main" and is_helped_chunk(positions, request):
        return request.split, request.end
    return None


def split_requests(
    unsplit: OpenSession, stage_peer: PeerId, helper_peer: PeerId, unit: int
) -> tuple[OpenSession, OpenSession]:
    """The route's stage's request and its helper's, cut at ``unit``, from the request
    the stage would get unsplit: the helper holds the prompt only, samples nothing and
    sends on to the stage."""
    main = dataclasses.replace(unsplit, split=unit, helper=helper_peer)
    helping = dataclasses.replace(
        unsplit,
        next_peer=stage_peer,
        max_tokens=unsplit.prompt_tokens,
        feed_steps=1,
        stop_ids=(),
        split=unit,
    )
    return main, helping


@dataclass(frozen=True, slots=True)
class Replica:
    """A ready replica that might help: its peer, units, format and load."""

    peer_id: PeerId
    start: int
    end: int
    weights: str
    busy: bool  # sessions on it, or requests waiting for it
    row_cost: float = 1.0  # its announced cost of a further row (lower: faster)
    cached_tokens: int = 0  # of the prompt, held in its prefix cache as far as is known
    block_step_s: float = 0.0  # its calibration's block step (0: not measured)


def choose_helper(
    main: Replica, replicas: Sequence[Replica], avoid: frozenset[PeerId]
) -> tuple[Replica, int] | None:
    """The idle replica to help ``main`` prefill: the same units in the same format
    (its KV and hidden states are then exactly what ``main`` would compute), on
    another peer, not avoided, holding at least the prompt's prefix that ``main``
    holds (the prefill starts where both hold it: a helper holding less would
    make ``main`` compute again what it has cached); the cheapest first. None when
    there is none, and the unit where to cut (:func:`split_unit`); a helper much
    slower than ``main`` (:data:`SLOWEST_HELPER`) is none."""
    if not main.weights:
        return None  # a format it does not announce cannot be matched
    found = [
        r
        for r in replicas
        if r.peer_id != main.peer_id
        and r.peer_id not in avoid
        and (r.start, r.end) == (main.start, main.end)
        and r.weights == main.weights
        and not r.busy
        and r.cached_tokens >= main.cached_tokens
        and not (0 < main.block_step_s * SLOWEST_HELPER < r.block_step_s)
    ]
    if not found:
        return None
    # the fastest measured first (unknown: as fast as main), then the cheapest row
    best = min(found, key=lambda r: (r.block_step_s or main.block_step_s, r.row_cost, r.peer_id))
    return best, split_unit(main.start, main.end, main.block_step_s, best.block_step_s)
