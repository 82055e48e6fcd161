"""Constrained decoding: a session's tokens kept inside a grammar (JSON schema output).

The grammar engine is llguidance (a Rust library with a small wheel and no
dependencies: no torch or CUDA pin, unlike xgrammar, whose wheel pulls triton).
A request carries its grammar as llguidance's JSON grammar text
(``SamplingParams.grammar``, built by :func:`json_schema_grammar`); the last
stage, where tokens are sampled, holds one :class:`Constraint` per session:
an ``LLMatcher`` over the model's tokenizer.

The mask of the allowed next tokens is computed off the hot path: on a worker
thread (llguidance releases the GIL), started as soon as the previous token is
known, so it runs while the step's forward does; the sampler then only waits
for it (normally done) and fills the disallowed logits with ``-inf``. The first
mask, and the tokenizer on first use, are built while the prompt is prefilled.

A constrained session that resumes mid-generation on a stage that did not
draw its earlier tokens (a replay after a failure, a move) cannot rebuild the
matcher's state there: its draw fails with ``InvalidRequest`` (which the
gateway does not replay) rather than emit text outside the grammar.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hetmesh.errors import InvalidRequest
from hetmesh.protocol.generate import MAX_GRAMMAR_BYTES

_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
_BITS = torch.arange(32, dtype=torch.int32)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar text for output that is one JSON value valid against ``schema``
    (compact: no whitespace between tokens); ``InvalidRequest`` for a schema the
    engine refuses."""
    import llguidance

    try:
        grammar: str = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"the schema cannot be enforced: {exc}", param="response_format"
        ) from exc
    check_grammar(grammar)
    return grammar


def lark_grammar(lark: str) -> str:
    """The grammar text of a Lark grammar (llguidance's dialect, ``%json`` included)."""
    import llguidance

    try:
        grammar: str = llguidance.grammar_from("lark", lark)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"the tools cannot be enforced: {exc}", param="tools") from exc
    check_grammar(grammar, "tools")
    return grammar


def check_grammar(grammar: str, param: str = "response_format") -> None:
    """``InvalidRequest`` unless ``grammar`` is grammar text the engine compiles."""
    import llguidance

    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"the schema's grammar is over {MAX_GRAMMAR_BYTES} bytes", param=param)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise InvalidRequest(f"the schema cannot be enforced: {error}", param=param)


class Grammars:
    """One model's grammar engine: its tokenizer, built once on first use (off the
    event loop: on a grammar worker); ``tokenizer``: the model's HF tokenizer."""

    def __init__(self, tokenizer: Callable[[], Any]) -> None:
        self._source = tokenizer
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._source())
            return self._tokenizer

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One session's grammar state and its next mask, computed ahead on a worker."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        self._grammars = grammars
        self._grammar = grammar
        self._matcher: Any = None
        self.consumed = 0  # tokens the matcher has taken: the next step it can mask
        self._next: Future[torch.Tensor] = _WORKERS.submit(self._start)

    def _start(self) -> torch.Tensor:
        import llguidance

        self._matcher = llguidance.LLMatcher(self._grammars.tokenizer(), self._grammar)
        return self._mask()

    def _mask(self) -> torch.Tensor:
        """The allowed next tokens as a bool vector over the tokenizer's vocabulary."""
        import llguidance.torch

        matcher = self._matcher
        if matcher.is_error():
            raise InvalidRequest(
                f"the grammar failed: {matcher.get_error()}", param="response_format"
            )
        size = self._grammars.tokenizer().vocab_size
        bitmask = llguidance.torch.allocate_token_bitmask(1, size)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> _BITS) & 1
        return bits.reshape(-1)[:size].bool()

    def apply(self, scores: torch.Tensor, step: int) -> torch.Tensor:
        """``scores`` (fp32 logits) with every token the grammar forbids at ``-inf``."""
        if step != self.consumed:
            raise InvalidRequest(
                f"a grammar-constrained session cannot resume at token {step} on a stage "
                "that did not draw its earlier tokens (after a failure or a move): retry it",
                param="response_format",
            )
        allowed = self._next.result()
        if not bool(allowed.any()):
            raise InvalidRequest("the grammar allows no next token", param="response_format")
        out = torch.full_like(scores, -torch.inf)
        size = min(allowed.numel(), scores.numel())
        out[:size] = scores[:size].masked_fill(~allowed[:size], -torch.inf)
        return out

    def advance(self, token: int) -> None:
        """Take the drawn ``token``; the next mask starts computing at once."""
        if not self._matcher.consume_token(int(token)):
            raise InvalidRequest(
                f"the grammar refused token {token}: {self._matcher.get_error()}",
                param="response_format",
            )
        self.consumed += 1
        self._next = _WORKERS.submit(self._mask)  # stopped: only end-of-sequence


__all__ = [
    "MAX_GRAMMAR_BYTES",
    "Constraint",
    "Grammars",
    "check_grammar",
    "json_schema_grammar",
    "lark_grammar",
]
