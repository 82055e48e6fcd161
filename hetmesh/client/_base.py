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
from hetmesh.error_codec import error_from_wire
from hetmesh.errors import InvalidRequest, MeshError, RemoteProtocolError
from hetmesh.protocol.generate import (
    Delta,
    Finish,
    GenerateRequest,
    SamplingParams,
    check_messages,
    reply_from_wire,
)

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


SamplingOptions = SamplingParams
"""The SDK's name for :class:`hetmesh.protocol.generate.SamplingParams` (the same class)."""


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
    return list(check_messages(messages))


def generate_request(
    prompt: str | Sequence[Message] | None, options: SamplingOptions, *, chat: bool = False
) -> dict[str, Any]:
    """The generate RPC request map (:meth:`GenerateRequest.to_wire`).

    With ``chat``, ``prompt`` is a conversation (a list of messages) or one user
    message's text; otherwise it is the prompt text.
    """
    if chat and not isinstance(prompt, str):
        messages = check_messages(prompt or ())
        return GenerateRequest(messages=messages, sampling=options).to_wire()
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("the prompt is empty")
    return GenerateRequest(prompt=prompt, chat=chat, sampling=options).to_wire()


decode_reply = reply_from_wire


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
        return error_from_wire(name, message)
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
    "seconds",
]
