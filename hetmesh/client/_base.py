"""The pure half of the SDK: options, timeouts, results, request building, reply decoding.

Nothing here does I/O or imports trio, libp2p or torch; :mod:`hetmesh.client.sdk`
drives it over a transport (libp2p or HTTP).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetmesh import errors
from hetmesh.errors import InvalidRequest, MeshError, RemoteProtocolError

Message = Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeout:
    """How long a request may take, in seconds (``None``: no limit).

    ``connect`` covers reaching the mesh (dial, handshake, opening the request
    stream); ``first_token`` the wait from sending the request to the first
    token (prefill, and waiting for a busy mesh); ``total`` the whole request.
    """

    connect: float | None = 10.0
    first_token: float | None = 60.0
    total: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("connect", "first_token", "total"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not value > 0
                or math.isnan(value)
            ):
                raise InvalidRequest(f"Timeout.{name} must be a positive number, got {value!r}")


def seconds(value: float | None) -> float:
    """A timeout for trio (``math.inf`` for no limit)."""
    return math.inf if value is None else float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """How tokens are picked; ``temperature`` None or 0 is greedy (deterministic)."""

    max_new_tokens: int = 128
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequest(
                f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        if self.temperature is not None and (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not integer(self.top_k) or self.top_k < 1):
            raise InvalidRequest(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, int | float)
            or not 0 < self.top_p <= 1
        ):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not integer(self.seed):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be a sequence of non-empty strings")

    @classmethod
    def of(cls, **sampling: Any) -> SamplingOptions:
        """From keyword arguments; ``stop`` may be one string; unknown names are refused."""
        unknown = sorted(set(sampling) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidRequest(f"unknown sampling option(s): {', '.join(unknown)}")
        stop = sampling.get("stop")
        if isinstance(stop, str):
            sampling["stop"] = (stop,)
        elif stop is not None:
            sampling["stop"] = tuple(stop)
        return cls(**{k: v for k, v in sampling.items() if v is not None})

    def to_wire(self) -> dict[str, Any]:
        """The sampling part of a generate RPC request (unset values left out)."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for key in ("temperature", "top_k", "top_p", "seed"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    def to_openai(self) -> dict[str, Any]:
        """The same options as an OpenAI-style request body (top_k as an extension)."""
        out: dict[str, Any] = {"max_tokens": self.max_new_tokens}
        for key in ("temperature", "top_k", "top_p", "seed"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.stop:
            out["stop"] = list(self.stop)
        return out


@dataclass(frozen=True, slots=True)
class Delta:
    """One piece of a streamed completion: its text and the token id it came from.

    ``token_id`` is None for a final text-only flush (text held back until the
    end, e.g. a partial multi-byte character or a possible stop string).
    """

    text: str
    token_id: int | None


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a stream: why it stopped and the token counts."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A finished generation."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
    prompt_tokens: int
    completion_tokens: int
    deltas: tuple[Delta, ...] = field(default=(), repr=False)


def collect(deltas: Sequence[Delta], finish: Finish | None) -> Completion:
    """A :class:`Completion` from a whole stream (``RemoteProtocolError`` if it never ended)."""
    if finish is None:
        raise RemoteProtocolError("the stream ended without a final message")
    return Completion(
        text="".join(d.text for d in deltas),
        token_ids=tuple(d.token_id for d in deltas if d.token_id is not None),
        finish_reason=finish.finish_reason,
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        deltas=tuple(deltas),
    )


def chat_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """A conversation as the generate RPC carries it (checked before it is sent)."""
    if not messages:
        raise InvalidRequest("messages is empty")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise InvalidRequest("each message needs a string 'content'")
        if m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequest(f"unknown message role {m.get('role')!r}")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return out


def generate_request(
    prompt: str | Sequence[Message] | None, options: SamplingOptions, *, chat: bool = False
) -> dict[str, Any]:
    """The generate RPC request map (see :mod:`hetmesh.client.protocol`).

    With ``chat``, ``prompt`` is a conversation (a list of messages) or one user
    message's text; otherwise it is the prompt text.
    """
    if chat and not isinstance(prompt, str):
        return {"messages": chat_messages(prompt or ()), **options.to_wire()}
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("the prompt is empty")
    request: dict[str, Any] = {"prompt": prompt, **options.to_wire()}
    if chat:
        request["chat"] = True
    return request


def remote_error(name: Any, message: Any) -> MeshError:
    """The local exception for an error a node reported by class name."""
    cls = getattr(errors, str(name), None)
    if isinstance(cls, type) and issubclass(cls, MeshError):
        try:
            return cls(str(message))
        except TypeError:
            pass
    return MeshError(f"{name}: {message}")


def decode_reply(reply: Mapping[str, Any]) -> Delta | Finish:
    """One generate RPC reply map as a :class:`Delta` or :class:`Finish`; errors raise."""
    if "error" in reply:
        raise remote_error(reply.get("error"), reply.get("message", ""))
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


# -- the HTTP (OpenAI-style) transport ---------------------------------------------

HTTP_ERRORS: dict[int, type[MeshError]] = {
    400: errors.InvalidRequest,
    404: errors.InvalidRequest,
    408: errors.RequestTimeout,
    413: errors.InvalidRequest,
    422: errors.InvalidRequest,
    429: errors.Rejected,
    503: errors.NoRoute,
    504: errors.RequestTimeout,
}


def http_error(status: int, body: Any) -> MeshError:
    """The exception for an OpenAI-style error body (or any body) with ``status``."""
    message = f"HTTP {status}"
    name = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        err = body["error"]
        message = str(err.get("message", message))
        name = err.get("hetmesh_error")
    if name:
        return remote_error(name, message)
    return HTTP_ERRORS.get(status, MeshError)(message)


def decode_sse_chunk(chunk: Mapping[str, Any]) -> list[Delta | Finish]:
    """Deltas (and the finish) carried by one streamed completion chunk.

    Chunks of ``/v1/completions`` carry ``choices[0].text``, chat chunks
    ``choices[0].delta.content``; hetmesh adds ``choices[0].token_ids``. The
    final chunk with ``usage`` gives the counts.
    """
    if isinstance(chunk.get("error"), Mapping):
        raise http_error(500, chunk)
    out: list[Delta | Finish] = []
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None and isinstance(choice.get("delta"), Mapping):
            text = choice["delta"].get("content")
        ids = choice.get("token_ids") or []
        if ids:
            out.append(Delta(str(text or ""), int(ids[0])))
            out.extend(Delta("", int(t)) for t in ids[1:])
        elif text:
            out.append(Delta(str(text), None))
        if choice.get("finish_reason"):
            out.append(Finish(str(choice["finish_reason"]), -1, -1))
    usage = chunk.get("usage")
    if isinstance(usage, Mapping):
        out.append(
            Finish("", int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
        )
    return out


__all__ = [
    "Completion",
    "Delta",
    "Finish",
    "Message",
    "SamplingOptions",
    "Timeout",
    "chat_messages",
    "collect",
    "decode_reply",
    "decode_sse_chunk",
    "generate_request",
    "http_error",
    "remote_error",
    "seconds",
]
