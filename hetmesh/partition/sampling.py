"""Choosing the next token from logits: greedy, or seeded temperature/top-k/top-p.

Each session owns one :class:`Sampler` with its own ``torch.Generator``, so
a seeded request draws the same tokens whatever else the process runs. The
generator is re-seeded for every step from ``(seed, step)`` (:func:`step_seed`),
so a session replayed on other peers after a failure draws exactly the
tokens it drew before, and a mesh draws what a single process draws.
Sampling happens in fp32 on the CPU, so the draw does not depend on the
device that produced the logits. A request with a ``grammar`` draws only
tokens the grammar allows (:mod:`hetmesh.partition.grammar`).

A draw that cannot be made raises from the error tree, for that session
alone (the stage server fails only its session): ``InvalidRequest`` when the
request's own values turn finite logits into inf/NaN (a temperature far below
any that :class:`SamplingParams` admits, from a peer that skipped the
check), ``ComputeError`` when the logits themselves are not finite.
"""

from __future__ import annotations

import hashlib
import math

import torch

from hetmesh.errors import ComputeError, InvalidRequest
from hetmesh.partition.grammar import Constraint, Grammars
from hetmesh.protocol.generate import SamplingParams  # the one sampling record, validated there
from hetmesh.protocol.logprobs import Sampled, TokenLogprobs


def step_seed(seed: int, step: int) -> int:
    """The generator seed of decode step ``step`` of a session seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


class Sampler:
    """Picks one token id from a logits vector; owns the session's generator."""

    def __init__(self, params: SamplingParams, grammars: Grammars | None = None) -> None:
        """``grammars``: the model's grammar engine, for a request with a ``grammar``
        (without one, such a request's first draw fails with ``InvalidRequest``)."""
        self.params = params
        self.generator = torch.Generator(device="cpu")
        # an unseeded session still seeds per step, from a seed drawn once
        self.seed = params.seed if params.seed is not None else self.generator.seed()
        self.constraint: Constraint | None = None
        if params.grammar and grammars is not None:
            self.constraint = grammars.constraint(params.grammar)

    def __call__(self, logits: torch.Tensor, step: int) -> int:
        """``logits``: ``(vocab,)`` for the position to fill; ``step``: tokens drawn so far.

        With ``params.logprobs`` set the id comes as a :class:`Sampled` carrying its
        log-probabilities (see :mod:`hetmesh.protocol.logprobs`)."""
        scores = logits.detach().reshape(-1).to("cpu", torch.float32)
        if not bool(torch.isfinite(scores).all()):
            raise ComputeError("the model produced non-finite logits")
        constraint = self.constraint
        if constraint is None and self.params.grammar:
            raise InvalidRequest("this stage cannot enforce a grammar", param="grammar")
        token = self._draw(scores if constraint is None else constraint.apply(scores, step), step)
        if constraint is not None:
            constraint.advance(token)
        if self.params.logprobs is None:
            return token
        return Sampled(token, token_logprobs(scores, token, self.params.logprobs))

    def _draw(self, scores: torch.Tensor, step: int) -> int:
        if self.params.greedy:
            return int(scores.argmax())
        self.generator.manual_seed(step_seed(self.seed, step))
        scores = scores / float(self.params.temperature or 1.0)  # not greedy: > 0
        if bool(torch.isnan(scores).any()) or not bool(torch.isfinite(scores.max())):
            # -inf entries are fine (masked out); +inf or NaN make softmax NaN
            raise InvalidRequest(
                f"temperature {self.params.temperature!r} makes the logits overflow",
                param="temperature",
            )
        if self.params.top_k is not None and self.params.top_k < scores.numel():
            kth = torch.topk(scores, self.params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.params.top_p is not None and self.params.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            # drop a token once the mass before it already reaches top_p (keep >= 1)
            drop = (cumulative - torch.softmax(ordered, dim=-1)) >= self.params.top_p
            scores = scores.scatter(0, order, ordered.masked_fill(drop, -math.inf))
        probs = torch.softmax(scores, dim=-1)
        try:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        except RuntimeError as exc:  # probabilities torch refuses: never the batch's problem
            raise ComputeError(f"sampling failed: {exc}") from exc


def token_logprobs(scores: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``scores`` (fp32 logits) and the ``top`` likeliest."""
    logprobs = torch.log_softmax(scores, dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(float(logprobs[token]), alternatives)


__all__ = ["Sampler", "SamplingParams", "step_seed", "token_logprobs"]
