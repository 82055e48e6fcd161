"""A draft model at the gateway: a compact copy of a model proposing greedy drafts.

The issue's case is the mesh's own model in a compact format (an int4 copy
drafting for a float32 mesh); a smaller model of the same tokenizer works
the same way. One :class:`DraftModel` holds the weights, once, in the
gateway's process (all of it in one stage: :class:`LocalPipeline`), and
hands each session a :class:`ModelDrafter` with its own KV cache.

``propose(history, k)`` first brings the session's cache in line with
``history``: it keeps the longest prefix of what it holds that ``history``
starts with (after a partial acceptance, the drafts past the first
rejected one are dropped with :meth:`SessionKV.truncate`: no copy) and
feeds the rest in one forward, then decodes ``k`` greedy tokens. The cache
then holds ``history`` and every draft but the last, so the next call, whose
history is this one's plus the kept drafts and the target's own token,
feeds one or two tokens before it drafts again.

Bounded: a history longer than the model's context (less ``k``) gets no
drafts, and one forward feeds at most ``max_prefill`` tokens (a longer
catch-up is fed in chunks). A drafter is ``blocking``: the gateway calls
it on a worker thread. The model's lock serialises every drafter's
``propose`` and ``close`` (one model's forwards at a time, and the KV of a
session closing never freed under a forward).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.formats import WeightFormat
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.kv import SessionKV
from hetmesh.speculative.budget import SpeculationBudget

DEFAULT_WEIGHTS = WeightFormat.INT4


class DraftModel:
    """The weights of a draft model, shared by the drafters of every session."""

    def __init__(self, pipeline: LocalPipeline, *, max_prefill: int = 512) -> None:
        if max_prefill < 1:
            raise InvalidRequest(f"max_prefill must be positive, not {max_prefill}")
        self.pipeline = pipeline
        self.max_prefill = max_prefill
        self._drafters: set[ModelDrafter] = set()
        # held by a drafter's propose and close: one forward of this model at a time
        self.lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model_dir: str | os.PathLike[str],
        *,
        weights: WeightFormat | str = DEFAULT_WEIGHTS,
        device: str | torch.device = "cpu",
        max_prefill: int = 512,
    ) -> DraftModel:
        """The model in ``model_dir`` as one stage in ``weights`` (int4 by default)."""
        return cls(
            LocalPipeline.load(model_dir, 1, device=device, weights=weights),
            max_prefill=max_prefill,
        )

    @property
    def max_context(self) -> int:
        return self.pipeline.profile.max_context

    def drafter(self) -> ModelDrafter:
        """A drafter with its own, empty KV cache, for one session."""
        drafter = ModelDrafter(self)
        self._drafters.add(drafter)
        return drafter

    def weight_bytes(self) -> int:
        return self.pipeline.resident_bytes()

    def resident_bytes(self) -> int:
        """The weights plus the KV every open drafter holds: what to charge the node."""
        return self.weight_bytes() + sum(d.kv_bytes for d in list(self._drafters))

    def _closed(self, drafter: ModelDrafter) -> None:
        self._drafters.discard(drafter)


class ModelDrafter:
    """A :class:`~hetmesh.speculative.drafter.Drafter` for one session, backed by a
    :class:`DraftModel`."""

    blocking = True  # k forwards of a model: the gateway calls it on a worker thread

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self._kvs: list[SessionKV] | None = [s.new_kv() for s in model.pipeline.stages]
        self._held: list[int] = []  # the tokens whose KV the cache holds, in order
        self.last_s = 0.0  # what the last proposal took (wall seconds): a budget's overhead

    @property
    def held(self) -> list[int]:
        """The tokens the cache holds (a copy)."""
        return list(self._held)

    @property
    def kv_bytes(self) -> int:
        return sum(kv.nbytes for kv in self._kvs or ())

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """``k`` greedy tokens of the draft model after ``history``; [] when ``k`` is 0,
        ``history`` is empty or too long for the model's context."""
        if k <= 0 or not history or len(history) + k > self.model.max_context:
            self.last_s = 0.0
            return []
        began = time.perf_counter()  # the wait for the model counts: the session waits
        with self.model.lock:
            if self._kvs is None:
                raise InvalidRequest("this drafter was closed")
            drafts = self._propose(self._kvs, history, k)
        self.last_s = time.perf_counter() - began
        return drafts

    def _propose(self, kvs: list[SessionKV], history: Sequence[int], k: int) -> list[int]:
        common = _common_prefix(self._held, history)
        # the last token of history is fed again when the cache holds it all: its
        # logits were not kept
        keep = min(common, len(history) - 1)
        if keep < len(self._held):
            for kv in kvs:
                kv.truncate(keep)
            del self._held[keep:]
        pipeline = self.model.pipeline
        drafts: list[int] = []
        pending = list(history[keep:])
        while len(drafts) < k:
            logits = None
            for start in range(0, len(pending), self.model.max_prefill):
                chunk = pending[start : start + self.model.max_prefill]
                logits = pipeline.forward(
                    torch.tensor(chunk, dtype=torch.int64), kvs, last_only=True
                )
                self._held.extend(chunk)
            assert logits is not None
            token = int(logits[-1].float().argmax())
            drafts.append(token)
            pending = [token]
        return drafts

    def close(self) -> None:
        with self.model.lock:
            if self._kvs is not None:
                for kv in self._kvs:
                    kv.free()
                self._kvs = None
                self._held = []
                self.model._closed(self)


def speculation(
    model: DraftModel, max_k: int
) -> Callable[[], tuple[ModelDrafter, SpeculationBudget]]:
    """A gateway's speculation for each request: a drafter of ``model`` and a measured
    budget of up to ``max_k`` drafts that counts the drafter's time in each step."""

    def make() -> tuple[ModelDrafter, SpeculationBudget]:
        drafter = model.drafter()
        return drafter, SpeculationBudget(max_k=max_k, overhead_s=lambda: drafter.last_s)

    return make


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = ["DEFAULT_WEIGHTS", "DraftModel", "ModelDrafter", "speculation"]
