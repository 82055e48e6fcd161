"""The generate request and its replies: one record for every surface.

A request enters the mesh at a node (its gateway) by the SDK over libp2p, by
the HTTP API, or by a script driving the node in-process; all of them build a
:class:`GenerateRequest` whose :class:`SamplingParams` are validated here, once.

The libp2p generate RPC (:data:`GENERATE_PROTOCOL`) carries it as one
length-prefixed msgpack map, :meth:`GenerateRequest.to_wire`: ``prompt``,
``prompt_ids`` or ``messages`` (a conversation of ``{"role", "content"}`` maps
put through the chat template), ``chat``, and the sampling keys
``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
``logprobs`` (:mod:`hetmesh.protocol.logprobs`), ``grammar`` (:mod:`hetmesh.partition.grammar`).
The node answers with a sequence of maps: ``{"token": id, "text": delta}`` per
generated token (``token`` -1 for a final text-only flush), then either
``{"done": true, "finish_reason", "prompt_tokens", "completion_tokens"}`` or
``{"error": name, "message": text}`` (the name from :func:`hetmesh.errors.error_name`).

Defaults, documented once:

- ``max_new_tokens`` is :data:`DEFAULT_MAX_NEW_TOKENS` (128) for the SDK, the
  libp2p RPC and in-process use.
- The HTTP API keeps OpenAI's documented behaviour for a body without
  ``max_tokens``: :data:`HTTP_DEFAULT_MAX_TOKENS` (16) for ``/v1/completions``,
  and for chat as many as the context leaves, capped at
  :data:`HTTP_DEFAULT_MAX_TOKENS_CHAT` (512); both never past the context.
- ``temperature`` unset or 0 is greedy; ``top_k``/``top_p`` unset do not filter;
  an unset ``seed`` is drawn by the gateway.

A generation ends with ``finish_reason`` ``"length"`` when it produced
``max_new_tokens`` tokens and ``"stop"`` otherwise (EOS or a stop string):
:func:`finish_reason`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from hetmesh.error_codec import error_from_wire, error_name
from hetmesh.errors import InvalidRequest, MeshError, RemoteProtocolError
from hetmesh.protocol.logprobs import MAX_TOP_LOGPROBS
from hetmesh.resources import WireRecord

GENERATE_PROTOCOL = "/hetmesh/generate/1.0.0"
MAX_REQUEST_BYTES = 4 << 20  # a request map, and every reply map

DEFAULT_MAX_NEW_TOKENS = 128
HTTP_DEFAULT_MAX_TOKENS = 16
HTTP_DEFAULT_MAX_TOKENS_CHAT = 512

# Bounds that keep every value representable where it goes: a seed feeds a 64-bit
# generator seed, token ids become int64 tensors and index a vocabulary (none is
# near 2**31); a temperature below MIN_TEMPERATURE divides fp32 logits into inf/NaN.
MAX_SEED = 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_COUNT = 2**31 - 1  # max_new_tokens, top_k: far past any context or vocabulary
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
MAX_GRAMMAR_BYTES = 32 * 1024  # a grammar travels in the session's OpenSession (64 KiB)

FinishReason = Literal["stop", "length"]
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams(WireRecord):
    """How a request picks tokens; ``temperature`` None or 0 is greedy (deterministic).

    Constructing one validates it: ``InvalidRequest`` (with ``param``) for a value
    out of bounds or of the wrong type. The same record travels to the last stage
    in a session's ``OpenSession`` (the gateway sets ``seed``).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # log-probabilities of each drawn token and of this many alternatives (None: none)
    logprobs: int | None = None
    # llguidance grammar text the tokens must follow (hetmesh.partition.grammar); "": none
    grammar: str = ""

    def __post_init__(self) -> None:
        if not _integer(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_COUNT:
            raise InvalidRequest(
                f"max_new_tokens must be an integer in [1, {MAX_COUNT}],"
                f" got {self.max_new_tokens!r}",
                param="max_new_tokens",
            )
        t = self.temperature
        if t is not None and (not _real(t) or not math.isfinite(t) or t < 0):
            raise InvalidRequest(f"temperature must be >= 0, got {t!r}", param="temperature")
        if t and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and"
                f" {MAX_TEMPERATURE}, got {t!r}",
                param="temperature",
            )
        if self.top_k is not None and (
            not _integer(self.top_k) or not 1 <= self.top_k <= MAX_COUNT
        ):
            raise InvalidRequest(
                f"top_k must be an integer in [1, {MAX_COUNT}], got {self.top_k!r}", param="top_k"
            )
        p = self.top_p
        if p is not None and (not _real(p) or not 0 < p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}", param="top_p")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(
                f"seed must be an integer in [0, 2**64), got {self.seed!r}", param="seed"
            )
        if not isinstance(self.stop, tuple) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise InvalidRequest("stop must be a sequence of non-empty strings", param="stop")
        if not isinstance(self.grammar, str) or len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(
                f"grammar must be a string of at most {MAX_GRAMMAR_BYTES} bytes", param="grammar"
            )
        k = self.logprobs
        if k is not None and (not _integer(k) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}",
                param="logprobs",
            )

    @property
    def greedy(self) -> bool:
        return not self.temperature

    @classmethod
    def of(cls, **sampling: Any) -> Self:
        """From keyword arguments or a wire map's sampling keys; ``stop`` may be one
        string; None means unset; unknown names are refused."""
        unknown = sorted(set(sampling) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidRequest(f"unknown sampling option(s): {', '.join(unknown)}")
        stop = sampling.get("stop")
        if isinstance(stop, str):
            sampling["stop"] = (stop,)
        elif isinstance(stop, list | tuple):
            sampling["stop"] = tuple(stop)
        return cls(**{k: v for k, v in sampling.items() if v is not None})

    @classmethod
    def from_request(cls, data: Mapping[str, object]) -> SamplingParams:
        """The sampling keys of a request map (other keys ignored); ``InvalidRequest``."""
        return cls.of(**{k: data.get(k) for k in cls.__dataclass_fields__})

    @classmethod
    def from_wire(cls, data: object) -> Self:
        """As :meth:`from_request`, with the :class:`WireRecord` contract: ``ValueError``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"SamplingParams: expected a map, got {type(data).__name__}")
        try:
            return cls.of(**{k: data.get(k) for k in cls.__dataclass_fields__})
        except InvalidRequest as exc:
            raise ValueError(f"SamplingParams: {exc}") from exc

    def to_wire(self) -> dict[str, object]:
        """The sampling part of a generate RPC request (unset values left out)."""
        out: dict[str, object] = {"max_new_tokens": self.max_new_tokens}
        for key in ("temperature", "top_k", "top_p", "seed", "logprobs"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.stop:
            out["stop"] = list(self.stop)
        if self.grammar:
            out["grammar"] = self.grammar
        return out

    def to_openai(self) -> dict[str, object]:
        """The same options as an OpenAI-style request body (top_k as an extension)."""
        out = self.to_wire()
        out["max_tokens"] = out.pop("max_new_tokens")
        return out


def check_messages(messages: object) -> tuple[dict[str, str], ...]:
    """A conversation (``[{"role", "content"}, ...]``) checked and copied; ``InvalidRequest``."""
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise InvalidRequest("each message needs a string 'content'", param="messages")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequest(f"unknown message role {m.get('role')!r}", param="messages")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """What to generate from: token ids, a conversation, or a prompt (``chat``: templated).

    When several are given, ``prompt_ids`` win over ``messages``, which win over
    ``prompt``. The chat template and tokenizer are applied by the gateway.
    """

    prompt: str | None = None
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[dict[str, str], ...] | None = None  # as check_messages returns them
    chat: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not all(_integer(t) and 0 <= t <= MAX_TOKEN_ID for t in self.prompt_ids):
            raise InvalidRequest(
                f"prompt_ids must be a list of token ids in [0, {MAX_TOKEN_ID}]",
                param="prompt_ids",
            )
        if self.prompt_ids or self.messages is not None:
            return
        if not isinstance(self.prompt, str) or not self.prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")

    @classmethod
    def from_wire(cls, data: Mapping[str, object]) -> GenerateRequest:
        """Validate a generate RPC request map; ``InvalidRequest`` when it is not one."""
        ids = data.get("prompt_ids") or ()
        if not isinstance(ids, list | tuple):
            raise InvalidRequest("prompt_ids must be a list of integers", param="prompt_ids")
        raw = data.get("messages")
        messages = check_messages(raw) if raw is not None else None
        prompt = data.get("prompt")
        return cls(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_ids=tuple(ids),
            messages=messages,
            chat=bool(data.get("chat")),
            sampling=SamplingParams.from_request(data),
        )

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.prompt_ids:
            out["prompt_ids"] = list(self.prompt_ids)
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.chat:
            out["chat"] = True
        return out | self.sampling.to_wire()


# -- replies ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delta:
    """One piece of a streamed completion: its text and the token id it came from.

    ``token_id`` is None for a final text-only flush (text held back until the
    end, e.g. a partial multi-byte character or a possible stop string).
    """

    text: str
    token_id: int | None

    def to_wire(self) -> dict[str, object]:
        return {"token": -1 if self.token_id is None else self.token_id, "text": self.text}


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a stream: why it stopped and the token counts."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def to_wire(self) -> dict[str, object]:
        return {
            "done": True,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def finish_reason(completion_tokens: int, max_new_tokens: int) -> FinishReason:
    """``"length"`` when the generation used all of ``max_new_tokens``, else ``"stop"``."""
    return "length" if completion_tokens >= max_new_tokens else "stop"


def error_reply(exc: MeshError) -> dict[str, object]:
    """The reply map that ends a stream with ``exc``."""
    return {"error": error_name(exc), "message": str(exc)}


def reply_from_wire(reply: Mapping[str, Any]) -> Delta | Finish:
    """One reply map as a :class:`Delta` or :class:`Finish`; an error reply raises it."""
    if "error" in reply:
        raise error_from_wire(reply.get("error"), reply.get("message", ""))
    if reply.get("done"):
        try:
            return Finish(
                str(reply.get("finish_reason", "")),
                int(reply.get("prompt_tokens", 0)),
                int(reply.get("completion_tokens", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"malformed final message {dict(reply)!r}") from exc
    token = reply.get("token")
    if isinstance(token, bool) or not isinstance(token, int):
        raise RemoteProtocolError(f"unexpected reply with keys {sorted(reply)}")
    text = reply.get("text", "")
    if not isinstance(text, str):
        raise RemoteProtocolError("a token's text is not a string")
    return Delta(text, token if token >= 0 else None)


__all__ = [
    "CHAT_ROLES",
    "DEFAULT_MAX_NEW_TOKENS",
    "GENERATE_PROTOCOL",
    "HTTP_DEFAULT_MAX_TOKENS",
    "HTTP_DEFAULT_MAX_TOKENS_CHAT",
    "MAX_COUNT",
    "MAX_GRAMMAR_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "MAX_TOKEN_ID",
    "MIN_TEMPERATURE",
    "Delta",
    "Finish",
    "FinishReason",
    "GenerateRequest",
    "SamplingParams",
    "check_messages",
    "error_reply",
    "finish_reason",
    "reply_from_wire",
]
