"""OpenAI-style requests and errors for the HTTP API (pure: no I/O, no trio, no torch).

:func:`parse_request` validates a completion or chat body into a
:class:`ParsedRequest`; :func:`api_error` maps the hetmesh error tree onto HTTP
statuses and OpenAI error types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetmesh import errors
from hetmesh.errors import MeshError

MAX_BODY_BYTES = 4 << 20
MAX_STOP_SEQUENCES = 4

# -- errors ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error answered as an OpenAI-style body with ``status``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    hetmesh_error: str = "InvalidRequest"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                "hetmesh_error": self.hetmesh_error,
            }
        }


# (status, OpenAI error type, code) per hetmesh error class; the first match wins
_STATUS: tuple[tuple[type[MeshError], int, str, str | None], ...] = (
    (errors.InvalidRequest, 400, "invalid_request_error", None),
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.Rejected, 429, "rate_limit_error", "busy"),
    (errors.RequestTimeout, 504, "timeout_error", "timeout"),
    (errors.SchedulingError, 503, "service_unavailable", "no_route"),
    (errors.TransportError, 502, "upstream_error", "transport"),
    (errors.ComputeError, 500, "server_error", "compute"),
)


def api_error(exc: MeshError) -> ApiError:
    """The HTTP answer for a hetmesh error (pure)."""
    for cls, status, kind, code in _STATUS:
        if isinstance(exc, cls):
            return ApiError(status, str(exc), kind, None, code, type(exc).__name__)
    return ApiError(500, str(exc), "server_error", None, "internal", type(exc).__name__)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# -- parsing requests (pure) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    """A validated completion or chat request."""

    chat: bool
    model: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[dict[str, str], ...] = ()
    max_tokens: int | None = None  # None: as many as the context allows (capped by default_max)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad_request(f"{key} must be between {low} and {high}, got {value}", key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    return value


def parse_request(body: Any, *, chat: bool, models: Sequence[str]) -> ParsedRequest:
    """Validate an OpenAI-style request body; :class:`ApiError` (4xx) when it is not one."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required (see GET /v1/models)", "model")
    if model not in models:
        raise ApiError(
            404,
            f"the model {model!r} does not exist here; "
            f"this mesh serves {', '.join(models) or 'nothing yet'}",
            "invalid_request_error",
            "model",
            "model_not_found",
            "InvalidRequest",
        )
    n = body.get("n", 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < 1:
        raise bad_request("top_k must be at least 1", "top_k")
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p must be greater than 0", "top_p")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise bad_request(f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    common: dict[str, Any] = {
        "chat": chat,
        "model": model,
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": top_p,
        "top_k": top_k,
        "seed": _integer(body, "seed"),
        "stop": stops,
        "stream": stream,
        "include_usage": bool(options.get("include_usage")),
    }
    if chat:
        return ParsedRequest(messages=_messages(body.get("messages")), **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("prompt is empty", "prompt")
        return ParsedRequest(prompt=prompt, **common)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return ParsedRequest(prompt_ids=tuple(prompt), **common)
    raise bad_request("prompt must be a non-empty string or a list of token ids", "prompt")


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
        ):
            raise bad_request("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise bad_request("each message needs a string content", "messages")
        role = "system" if m["role"] == "developer" else str(m["role"])
        out.append({"role": role, "content": content})
    return tuple(out)


__all__ = [
    "MAX_BODY_BYTES",
    "ApiError",
    "ParsedRequest",
    "api_error",
    "bad_request",
    "parse_request",
]
