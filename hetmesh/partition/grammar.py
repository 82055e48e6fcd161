"""Constrained decoding: a session's tokens kept inside a grammar (JSON schema output).

The grammar engine is llguidance (a Rust library with a small wheel and no
dependencies: no torch or CUDA pin, unlike xgrammar, whose wheel pulls triton).
A request carries its grammar as llguidance's JSON grammar text
(``SamplingParams.grammar``, built by :func:`json_schema_grammar`); the last
stage, where tokens are sampled, holds one :class:`Constraint` per session:
an ``LLMatcher`` over the model's tokenizer.

The grammar's work is off the hot path: on a worker thread (llguidance releases
the GIL), the matcher takes the drawn token and computes the next mask as soon
as the token is known, so both run while the next step's forward does; the
sampler then only waits for the mask (normally done) and fills the disallowed
logits with ``-inf``. The first
mask, and the tokenizer on first use, are built while the prompt is prefilled.

A constrained session that resumes mid-generation on a stage that did not
draw its earlier tokens (a replay after a failure, a move) rebuilds the
matcher's state there: its gateway names the tokens drawn so far
(``OpenSession.drawn``) and the new matcher takes them before its first mask.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hetmesh.errors import ComputeError, InvalidRequest
from hetmesh.protocol.generate import MAX_GRAMMAR_BYTES

_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")


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

    def constraint(self, grammar: str, drawn: Sequence[int] = ()) -> Constraint:
        return Constraint(self, grammar, drawn)


class Constraint:
    """One session's grammar state and its next mask, computed ahead on a worker."""

    def __init__(self, grammars: Grammars, grammar: str, drawn: Sequence[int] = ()) -> None:
        """``drawn``: the tokens a resumed session drew before (on another stage, or
        before a replay); the matcher takes them before its first mask."""
        self._grammars = grammars
        self._grammar = grammar
        self._matcher: Any = None
        self._bitmask: torch.Tensor | None = None
        self._drawn = tuple(int(t) for t in drawn)
        self.consumed = len(self._drawn)  # tokens the matcher has taken: the next step
        self._next: Future[torch.Tensor] = _WORKERS.submit(self._start)

    def _start(self) -> torch.Tensor:
        import llguidance

        self._matcher = llguidance.LLMatcher(self._grammars.tokenizer(), self._grammar)
        for token in self._drawn:
            if not self._matcher.consume_token(token):
                raise InvalidRequest(
                    f"the grammar refused the resumed session's token {token}: "
                    f"{self._matcher.get_error()}",
                    param="response_format",
                )
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
        if self._bitmask is None:  # one per session: masks are computed one at a time
            self._bitmask = llguidance.torch.allocate_token_bitmask(1, size)
        llguidance.torch.fill_next_token_bitmask(matcher, self._bitmask, 0)  # GIL released
        # one C call to unpack: a worker that holds the GIL over many small torch ops
        # makes the sampling thread wait for it (ms a token on a busy CPU)
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[:size].view(np.bool_))

    def apply(self, scores: torch.Tensor, step: int) -> torch.Tensor:
        """``scores`` (fp32 logits) with every token the grammar forbids at ``-inf``."""
        if step != self.consumed:
            raise ComputeError(
                f"a grammar-constrained session resumed at token {step} with "
                f"{self.consumed} drawn tokens: its grammar's state does not match"
            )
        allowed = self._next.result()
        if not bool(allowed.any()):
            raise InvalidRequest("the grammar allows no next token", param="response_format")
        out = torch.full_like(scores, -torch.inf)
        size = min(allowed.numel(), scores.numel())
        out[:size] = scores[:size].masked_fill(~allowed[:size], -torch.inf)
        return out

    def advance(self, token: int) -> None:
        """Take the drawn ``token`` and compute the next mask, both on a worker: the
        matcher's advance costs ms on some tokens (llguidance extends its lexer
        lazily), so it overlaps the next forward rather than delay this draw."""
        self._next.result()  # done already: :meth:`apply` waited for it
        self.consumed += 1
        self._next = _WORKERS.submit(self._consume, int(token))  # stopped: only EOS

    def _consume(self, token: int) -> torch.Tensor:
        if not self._matcher.consume_token(token):
            raise InvalidRequest(
                f"the grammar refused token {token}: {self._matcher.get_error()}",
                param="response_format",
            )
        return self._mask()


__all__ = [
    "MAX_GRAMMAR_BYTES",
    "Constraint",
    "Grammars",
    "check_grammar",
    "json_schema_grammar",
    "lark_grammar",
]
