"""KV migration: moving a live session's stage to another peer without replaying it.

When a planned change moves a stage of a running session (a re-plan gives
its units to another node, the node drains), the session's gateway, between
two steps, moves it in three steps:

1. it opens the session on the new peer with ``OpenSession(migrate_from=old
   peer, prompt_tokens=tokens held)``: the new stage admits the blocks through
   its pool like any session (refused when they do not fit) and waits for
   the KV from the old peer, holding any activation that arrives first;
2. it sends ``MoveSession`` to every stage of the old route: the moving one
   exports the filled part of its blocks (in its KV dtype) as one
   :class:`~hetmesh.transport.frames.KVBlock` to the new peer over the data
   plane and lets the session go; the others only change their neighbours;
3. it sends the next step on the new route.

The new stage takes the ``KVBlock`` only from the peer named in step 1 and
only when its shapes and dtype match its own layers and the length it
admitted (:func:`check_kv`). Any failure — refused, the source or the target
gone, a bad frame — makes the gateway fall back to replaying the history,
which stays the path for a stage that died.

This module holds the pure parts: pairing the old route with the new one
and checking a received frame. It does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetmesh.errors import InvalidRequest
from hetmesh.node.hop import Hop
from hetmesh.resources import PeerId
from hetmesh.transport.frames import KVBlock


def moves(old: Sequence[Hop], new: Sequence[Hop]) -> list[tuple[int, PeerId, PeerId]] | None:
    """``(index, old peer, new peer)`` of each stage that changes peer between two routes.

    None when the routes cut the model differently (their KV cannot be
    moved stage by stage: replay) or when nothing moves.
    """
    if len(old) != len(new):
        return None
    if any((a.start, a.end) != (b.start, b.end) for a, b in zip(old, new, strict=True)):
        return None
    changed = [(i, a.peer_id, b.peer_id) for i, (a, b) in enumerate(zip(old, new, strict=True))]
    found = [c for c in changed if c[1] != c[2]]
    return found or None


def kv_frame(session_id: str, keys: torch.Tensor, values: torch.Tensor, start: int = 0) -> KVBlock:
    """The frame carrying a session's exported KV: the stage's layers from the first
    (a migration's: all of them; a split prefill's: its helper's), positions from
    ``start``."""
    return KVBlock(session_id=session_id, first_layer=0, start=start, tensors=(keys, values))


def check_kv(
    frame: KVBlock,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    length: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``frame`` if they fit the stage that admitted ``length``
    tokens for it: ``num_layers`` layers from the first, ``length`` positions from
    ``start`` (a migration: all of its layers from 0; a split prefill: the helper's
    layers from where the prompt began); ``InvalidRequest`` naming what does not."""
    if frame.first_layer != 0 or frame.start != start:
        raise InvalidRequest(
            f"the KV must cover layers from 0 and positions from {start}, not layers "
            f"from {frame.first_layer} and positions from {frame.start}"
        )
    if len(frame.tensors) != 2:
        raise InvalidRequest(f"migrated KV is keys and values, got {len(frame.tensors)} tensors")
    expected = (num_layers, kv_heads, length, head_dim)
    for name, tensor in zip(("keys", "values"), frame.tensors, strict=True):
        if tensor.dtype != dtype:
            raise InvalidRequest(f"migrated {name} are {tensor.dtype}, this stage holds {dtype}")
        if tuple(tensor.shape) != expected:
            raise InvalidRequest(
                f"migrated {name} have shape {tuple(tensor.shape)}, this stage expects {expected}"
            )
    return frame.tensors[0], frame.tensors[1]


__all__ = ["check_kv", "kv_frame", "moves"]
