"""Generation in one process by chaining stages: the local reference pipeline.

``hetmesh generate`` uses it, and tests compare the mesh against it. The loop
is the one a distributed pipeline runs too: prefill the prompt through every
stage, then one token at a time, each stage with its own session KV cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.formats import NATIVE, WeightFormat
from hetmesh.partition.grammar import Grammars
from hetmesh.partition.kv import SessionKV
from hetmesh.partition.profile import model_profile
from hetmesh.partition.sampling import Sampler, SamplingParams
from hetmesh.partition.stage import StageModule, load_stage
from hetmesh.partition.store import check_model_dir
from hetmesh.partition.text import StopMatcher, TextStream, eos_token_ids, load_tokenizer
from hetmesh.resources import ModelProfile


def balanced_ranges(profile: ModelProfile, num_stages: int) -> list[tuple[int, int]]:
    """Split the units into ``num_stages`` contiguous ranges minimising the largest.

    Balances parameter counts (a tied head counts its matrix, as a stage holding
    it must load it). Exact, by dynamic programming over cut points.
    """
    n = profile.num_units
    if not 1 <= num_stages <= n:
        raise InvalidRequest(f"cannot cut {n} units into {num_stages} stages (1..{n})")
    weights = [u.param_count for u in profile.units]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest largest-stage cost splitting units[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges: list[tuple[int, int]] = []
    end = n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


@dataclass
class Session:
    """One generation's state across the local pipeline."""

    kvs: list[SessionKV]
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)

    def free(self) -> None:
        for kv in self.kvs:
            kv.free()


class LocalPipeline:
    """Stages covering a whole model, chained in this process."""

    def __init__(self, stages: Sequence[StageModule], *, model_dir: str | os.PathLike[str]) -> None:
        if not stages:
            raise InvalidRequest("a pipeline needs at least one stage")
        expected = 0
        for stage in stages:
            if stage.start != expected:
                raise InvalidRequest(f"stages must be contiguous: gap before unit {stage.start}")
            expected = stage.end
        if expected != stages[0].profile.num_units:
            raise InvalidRequest(f"stages stop at unit {expected} of {stages[0].profile.num_units}")
        self.stages = list(stages)
        self.model_dir = Path(model_dir)
        self.profile = stages[0].profile
        self._tokenizer: Any = None
        self._eos: set[int] | None = None
        self._grammars: Grammars | None = None

    @classmethod
    def load(
        cls,
        model_dir: str | os.PathLike[str],
        num_stages: int = 1,
        *,
        device: str | torch.device = "cpu",
        weights: WeightFormat | str = NATIVE,
        dtype: torch.dtype | None = None,
    ) -> LocalPipeline:
        """Load ``num_stages`` balanced stages holding their weights in ``weights``.

        ``dtype`` is the older spelling of the float formats (see ``load_stage``).
        """
        profile = model_profile(check_model_dir(Path(model_dir)))
        ranges = balanced_ranges(profile, num_stages)
        stages = [
            load_stage(model_dir, a, b, device=device, weights=weights, dtype=dtype)
            for a, b in ranges
        ]
        return cls(stages, model_dir=model_dir)

    @property
    def weights(self) -> WeightFormat:
        return self.stages[0].weights

    def resident_bytes(self) -> int:
        """Bytes of the tensors of every stage (what one process holding them all needs)."""
        return sum(stage.resident_bytes() for stage in self.stages)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    @property
    def eos_ids(self) -> set[int]:
        if self._eos is None:
            self._eos = eos_token_ids(self.model_dir, self.tokenizer)
        return self._eos

    def new_session(self, params: SamplingParams) -> Session:
        if params.grammar and self._grammars is None:  # JSON-schema output: the tokenizer's
            self._grammars = Grammars(lambda: self.tokenizer)
        sampler = Sampler(params, self._grammars)
        return Session(kvs=[s.new_kv() for s in self.stages], sampler=sampler)

    def forward(
        self, inputs: torch.Tensor, kvs: Sequence[SessionKV], *, last_only: bool = False
    ) -> torch.Tensor:
        """Token ids ``(seq,)`` through every stage: logits ``(seq, vocab)``."""
        x = inputs
        for stage, kv in zip(self.stages, kvs, strict=True):
            x = stage.forward(x, kv, last_only=last_only and stage.has_head)
        return x

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_ids: set[int] | None = None,
    ) -> Iterator[int]:
        """Yield new token ids until an end-of-sequence id or ``max_new_tokens``."""
        if not prompt_ids:
            raise InvalidRequest("empty prompt")
        if len(prompt_ids) + params.max_new_tokens > self.profile.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.profile.max_context}"
            )
        stop_ids = self.eos_ids if eos_ids is None else eos_ids
        session = self.new_session(params)
        try:
            inputs = torch.tensor(list(prompt_ids), dtype=torch.int64)
            for step in range(params.max_new_tokens):
                logits = self.forward(inputs, session.kvs, last_only=True)  # (1, vocab)
                token = session.sampler(logits[-1], step)
                if token in stop_ids:
                    return
                session.tokens.append(token)
                yield token
                inputs = torch.tensor([token], dtype=torch.int64)
        finally:
            session.free()

    def generate_text(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[str]:
        """Yield text deltas, honouring ``params.stop``; never splits a character."""
        stream = TextStream(self.tokenizer)
        stops = StopMatcher(params.stop)
        tokens = self.generate_ids(prompt_ids, params)
        try:
            for token in tokens:
                delta = stops.feed(stream.push(token))
                if delta:
                    yield delta
                if stops.stopped:
                    return
            tail = stops.feed(stream.flush()) + stops.flush()
            if tail:
                yield tail
        finally:
            tokens.close()  # type: ignore[attr-defined]


__all__ = ["LocalPipeline", "Session", "balanced_ranges"]
