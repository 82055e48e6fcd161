"""OpenAI-style requests and errors for the HTTP API (pure: no I/O, no trio, no torch).

:func:`parse_api_request` validates a completion or chat body into an
:class:`ApiRequest` (a :class:`~hetmesh.protocol.generate.GenerateRequest` and
what only HTTP has); :func:`api_error` maps the hetmesh error tree onto HTTP
statuses and OpenAI error types, naming the error's class with
:func:`~hetmesh.errors.error_name` (``error.hetmesh_error``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetmesh import errors
from hetmesh.error_codec import error_name
from hetmesh.errors import InvalidRequest, MeshError
from hetmesh.node.api_fields import unsupported_field
from hetmesh.node.api_tools import Tools, parse_tools, render_messages
from hetmesh.protocol.generate import (
    HTTP_DEFAULT_MAX_TOKENS,
    HTTP_DEFAULT_MAX_TOKENS_CHAT,
    MAX_TOKEN_ID,
    GenerateRequest,
    SamplingParams,
)
from hetmesh.protocol.logprobs import MAX_TOP_LOGPROBS

MAX_BODY_BYTES = 4 << 20
# No tokenizer's token spans more characters than this, so a prompt longer than
# the context times it cannot fit: refused before the tokenizer runs on it.
MAX_CHARS_PER_TOKEN = 128
DEFAULT_MAX_REQUESTS_PER_CLIENT = 4
# completions in flight per API key (whatever address they come from, loopback too)
DEFAULT_MAX_REQUESTS_PER_KEY = 16
MAX_STOP_SEQUENCES = 4  # OpenAI's limits, on top of the sampling record's own bounds
MAX_CHOICES = 8  # n: each choice is a session of its own
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
OPENAI_MAX_TEMPERATURE = 2.0

# -- errors ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error answered as an OpenAI-style body with ``status``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    hetmesh_error: str = error_name(errors.InvalidRequest)

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
            param = getattr(exc, "param", None)
            return ApiError(status, str(exc), kind, param, code, error_name(exc))
    return ApiError(500, str(exc), "server_error", None, "internal", error_name(exc))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# -- parsing requests (pure) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiRequest:
    """A validated completion or chat body: the :class:`GenerateRequest` it asks for,
    and what only the HTTP surface has (the model name, streaming, usage)."""

    model: str
    request: GenerateRequest
    max_tokens: int | None = None  # as given; None: the surface's default, capped by the context
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices, each its own session (the prefix cache shares the prompt's KV)
    logprobs: bool = False  # the choices carry log-probabilities (request.sampling.logprobs)
    schema: dict[str, Any] | None = None  # response_format: the JSON schema output must follow
    tools: Tools | None = None  # tools and tool_choice (hetmesh.node.api_tools)

    @property
    def chat(self) -> bool:
        return self.request.chat


def default_max_tokens(chat: bool, room: int) -> int:
    """``max_tokens`` of a body without one: OpenAI's default, never past the context."""
    return min(HTTP_DEFAULT_MAX_TOKENS_CHAT if chat else HTTP_DEFAULT_MAX_TOKENS, room)


def _sampling(
    body: Mapping[str, Any], max_tokens: Any, stop: tuple[str, ...], logprobs: int | None
) -> SamplingParams:
    """The sampling fields, through the one validator (OpenAI's names in its errors)."""
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and temperature > OPENAI_MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be between 0 and {OPENAI_MAX_TEMPERATURE}, got {temperature}",
            "temperature",
        )
    try:
        return SamplingParams.of(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=body.get("top_k"),
            top_p=body.get("top_p"),
            seed=body.get("seed"),
            stop=stop,
            logprobs=logprobs,
        )
    except InvalidRequest as exc:
        param = "max_tokens" if exc.param == "max_new_tokens" else exc.param
        raise bad_request(str(exc).replace("max_new_tokens", "max_tokens"), param) from exc


def parse_api_request(body: Any, *, chat: bool, models: Sequence[str]) -> ApiRequest:
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
            error_name(errors.InvalidRequest),
        )
    unsupported = unsupported_field(body, chat=chat)
    if unsupported is not None:
        raise bad_request(unsupported[1], unsupported[0], "unsupported_parameter")
    n = body.get("n")
    n = 1 if n is None else n
    if not _integer(n) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    top = _logprobs(body, chat)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
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
    # a placeholder length when none is given: the real default needs the prompt's length
    placeholder = max_tokens if max_tokens is not None else 1
    sampling = _sampling(body, placeholder, stops, top)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "include_usage": bool(options.get("include_usage")),
        "n": n,
        "logprobs": top is not None,
        "schema": _response_schema(body.get("response_format")) if chat else None,
    }
    if chat:
        tools = _tools(body)
        common["tools"] = tools
        messages = _messages(body.get("messages"), tools)
        request = GenerateRequest(messages=messages, chat=True, sampling=sampling)
        return ApiRequest(request=request, **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("prompt is empty", "prompt")
        return ApiRequest(request=GenerateRequest(prompt=prompt, sampling=sampling), **common)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise bad_request(f"token ids must lie in [0, {MAX_TOKEN_ID}]", "prompt")
        request = GenerateRequest(prompt_ids=tuple(prompt), sampling=sampling)
        return ApiRequest(request=request, **common)
    raise bad_request("prompt must be a non-empty string or a list of token ids", "prompt")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """How many alternatives each token's log-probabilities list (None: none asked).

    Chat: ``logprobs`` a boolean, ``top_logprobs`` an integer in [0, 20] that needs
    it; completions: ``logprobs`` the integer itself (OpenAI's legacy shape)."""
    given = body.get("logprobs")
    if chat:
        if given is not None and not isinstance(given, bool):
            raise bad_request("logprobs must be a boolean", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not given:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if top is not None and (not _integer(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad_request(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
            )
        return (top or 0) if given else None
    if given is None:
        return None
    if not _integer(given) or not 0 <= given <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return int(given)


def _response_schema(given: Any) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks output to follow (None: free text)."""
    if given is None:
        return None
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad_request(
            "response_format must be {type: text}, {type: json_object} or "
            "{type: json_schema, json_schema: {name, schema, strict}}",
            "response_format",
        )
    spec = given.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema needs a name", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be an object", "response_format")
    return schema


def prompt_chars(request: GenerateRequest) -> int:
    """Characters the tokenizer would read for ``request`` (0 for given token ids)."""
    if request.prompt_ids:
        return 0
    if request.messages is not None:
        return sum(len(m["content"]) for m in request.messages)
    return len(request.prompt or "")


def check_prompt_chars(request: GenerateRequest, context: int) -> None:
    """Refuse, before tokenising, a prompt that cannot fit ``context`` tokens (400)."""
    chars = prompt_chars(request)
    if chars > context * MAX_CHARS_PER_TOKEN:
        raise bad_request(
            f"the prompt has {chars} characters: more than the context of {context} tokens holds",
            "messages" if request.chat else "prompt",
            "context_length_exceeded",
        )


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _split_host(value: str) -> tuple[str, int | None]:
    """``name[:port]`` (IPv6 in brackets) as (lower-case name, port or None); ("", None)
    for what does not parse."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            return "", None
    else:
        name, _, port_text = value.partition(":")
    if port_text and not port_text.isdigit():
        return "", None
    return name, int(port_text) if port_text else None


def foreign_request(
    host: str, origin: str | None, *, allowed: frozenset[str], port: int | None
) -> str | None:
    """Why a request to an API without a key (loopback only) comes from elsewhere, or None.

    ``host``: the request's Host header; ``origin``: its Origin header, if any;
    ``allowed``: host names this API answers to (loopback names and the one it was
    told to bind); ``port``: the port it listens on (None: not known yet). A web
    page the operator visits may send requests to the loopback API (CSRF), through
    a name of its own that resolves to 127.0.0.1 (DNS rebinding): its Origin, or
    the name in Host, betrays it.
    """
    name, given = _split_host(host)
    if name not in allowed or (given is not None and port is not None and given != port):
        return f"Host {host!r} is not this API's (it answers to {', '.join(sorted(allowed))})"
    if origin is None:
        return None
    scheme, sep, rest = origin.strip().lower().partition("://")
    name, given = _split_host(rest) if sep and scheme in ("http", "https") else ("", None)
    if given is None and name:
        given = 443 if scheme == "https" else 80
    if name not in allowed or (port is not None and given != port):
        return f"Origin {origin!r} is not this API's own: cross-site requests are refused"
    return None


def check_json_body(content_type: str | None) -> None:
    """A request body must say it is JSON (a form or text/plain post from a web page
    cannot); raises a 415 :class:`ApiError` otherwise."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"the body must be sent as Content-Type: application/json, not {content_type!r}",
            code="unsupported_media_type",
        )


class ClientLimits:
    """How many requests each client may have in flight at once (pure bookkeeping).

    A client is what :meth:`acquire` is given (the HTTP API passes the peer
    address). Only clients holding a slot have an entry, so a stranger cycling
    through addresses leaves nothing behind.
    """

    def __init__(self, per_client: int) -> None:
        if per_client < 1:
            raise ValueError("per_client must be at least 1")
        self.per_client = per_client
        self._active: dict[str, int] = {}

    def acquire(self, client: str) -> bool:
        """Take one of ``client``'s slots; False when it holds them all already."""
        held = self._active.get(client, 0)
        if held >= self.per_client:
            return False
        self._active[client] = held + 1
        return True

    def release(self, client: str) -> None:
        held = self._active.get(client, 0) - 1
        if held > 0:
            self._active[client] = held
        else:
            self._active.pop(client, None)

    def active(self, client: str) -> int:
        return self._active.get(client, 0)


def _messages(raw: Any, tools: Tools | None) -> tuple[dict[str, str], ...]:
    """The conversation as template turns (tool calls and results rendered: api_tools)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise bad_request(
                "each message needs a role of system, developer, user, assistant or tool",
                "messages",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise bad_request("each message needs a string content", "messages")
        role = "system" if m["role"] == "developer" else str(m["role"])
        out.append({"role": role, "content": content, "tool_calls": m.get("tool_calls")})
    try:
        return tuple(render_messages(out, tools))
    except InvalidRequest as exc:
        raise bad_request(str(exc), exc.param) from exc


def _tools(body: Mapping[str, Any]) -> Tools | None:
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except InvalidRequest as exc:
        raise bad_request(str(exc), exc.param) from exc
    fmt = body.get("response_format")
    if tools is not None and tools.active and isinstance(fmt, dict) and fmt.get("type") != "text":
        raise bad_request("response_format together with tools is not supported", "response_format")
    return tools


__all__ = [
    "DEFAULT_MAX_REQUESTS_PER_CLIENT",
    "DEFAULT_MAX_REQUESTS_PER_KEY",
    "MAX_BODY_BYTES",
    "MAX_CHARS_PER_TOKEN",
    "ApiError",
    "ApiRequest",
    "ClientLimits",
    "api_error",
    "bad_request",
    "check_prompt_chars",
    "default_max_tokens",
    "parse_api_request",
    "prompt_chars",
]
