"""The node's HTTP API: OpenAI-compatible completions, health, Prometheus metrics.

```
serve_api(node, port)                  started by run_node when --api-port is given
└── serve_http(NodeBackend(node))
    ├── hypercorn (trio worker)        Starlette app: /v1/models, /v1/completions,
    │                                  /v1/chat/completions, /health, /metrics,
    │                                  /v1/hetmesh/status
    └── one producer task per stream   drives Serving.stream into a memory channel
```

Requests enter the mesh at this node (it is their gateway). Errors are
OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
status for the client's mistakes and 429/503/504 for a busy or broken mesh; the
error's hetmesh class travels as ``error.hetmesh_error`` so the SDK raises the
same exception a libp2p client would. Streams (``"stream": true``) are
server-sent events ending with ``data: [DONE]``; every chunk's choice carries
the hetmesh extension ``token_ids``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hetmesh import errors
from hetmesh.errors import InvalidRequest, MeshError

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from hetmesh.node.daemon import Node
    from hetmesh.partition.sampling import SamplingParams

log = logging.getLogger(__name__)

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


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
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
        raise _bad(f"{key} must be a number", key)
    if not low <= value <= high:
        raise _bad(f"{key} must be between {low} and {high}, got {value}", key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer", key)
    return value


def parse_request(body: Any, *, chat: bool, models: Sequence[str]) -> ParsedRequest:
    """Validate an OpenAI-style request body; :class:`ApiError` (4xx) when it is not one."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (see GET /v1/models)", "model")
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
        raise _bad("only n=1 is supported", "n")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < 1:
        raise _bad("top_k must be at least 1", "top_k")
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be greater than 0", "top_p")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise _bad(f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
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
            raise _bad("prompt is empty", "prompt")
        return ParsedRequest(prompt=prompt, **common)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return ParsedRequest(prompt_ids=tuple(prompt), **common)
    raise _bad("prompt must be a non-empty string or a list of token ids", "prompt")


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
        ):
            raise _bad("each message needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise _bad("each message needs a string content", "messages")
        role = "system" if m["role"] == "developer" else str(m["role"])
        out.append({"role": role, "content": content})
    return tuple(out)


# -- what the app needs from a node ---------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshGauges:
    """The node-side figures /metrics exports (read at scrape time)."""

    ready: bool = False
    plan_epoch: int = -1
    queue_depth: int = 0
    active_sessions: int = 0
    gateway_sessions: int = 0
    kv_bytes_used: int = 0
    kv_bytes_free: int = 0
    recoveries: int = 0
    rejected_busy: int = 0
    tokens_out: int = 0
    sessions_failed: int = 0
    links: tuple[tuple[str, str, float, float], ...] = ()  # src, dst, rtt_s, bandwidth_bps


class Backend(Protocol):
    """The node as the app sees it (a fake stands in for it in unit tests)."""

    def models(self) -> list[str]: ...
    def max_context(self) -> int: ...
    def ready(self) -> bool: ...
    async def encode(self, request: ParsedRequest) -> list[int]: ...
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]: ...
    def gauges(self) -> MeshGauges: ...
    def view(self) -> dict[str, Any]: ...


class NodeBackend:
    """A running node's :class:`~hetmesh.node.serving.Serving` behind the API."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def _serving(self) -> Any:
        serving = self.node.serving
        if serving is None or serving.gateway is None:
            raise errors.NoRoute("this node does not serve a model (started with --no-serve?)")
        return serving

    def models(self) -> list[str]:
        serving = self.node.serving
        return [serving.model_key] if serving is not None else []

    def max_context(self) -> int:
        return int(self._serving().constraints.max_context_tokens)

    def ready(self) -> bool:
        serving = self.node.serving
        if serving is None or serving.plan is None:
            return False
        ready = serving.ready_stages()
        return any(
            all((s.peer_id, s.start, s.end) in ready for s in p.stages)
            for p in serving.plan.pipelines
        )

    async def encode(self, request: ParsedRequest) -> list[int]:
        serving = self._serving()
        if request.prompt_ids:
            return list(request.prompt_ids)
        if not request.chat:
            return await trio.to_thread.run_sync(serving.encode, request.prompt, None, False)
        tokenizer = serving.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the model has no chat template: use /v1/completions")

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(
                list(request.messages), tokenize=False, add_generation_prompt=True
            )
            return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

        return await trio.to_thread.run_sync(render)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        stream: AsyncGenerator[tuple[int, str], None] = self._serving().stream(prompt_ids, params)
        return stream

    def gauges(self) -> MeshGauges:
        serving = self.node.serving
        load = self.node.discovery.load
        links = tuple(
            (str(link.src), str(link.dst), float(link.rtt_s), float(link.bandwidth_bps))
            for link in self.node.discovery.local_record(advance=False).links
        )
        gateway = serving.gateway.statistics() if serving and serving.gateway else None
        return MeshGauges(
            ready=self.ready(),
            plan_epoch=serving.plan.epoch if serving and serving.plan else -1,
            queue_depth=load.queue_depth,
            active_sessions=load.active_sessions,
            gateway_sessions=gateway.active_sessions if gateway else 0,
            kv_bytes_used=load.kv_bytes_used,
            kv_bytes_free=load.kv_bytes_free,
            recoveries=gateway.recoveries if gateway else 0,
            rejected_busy=gateway.rejected_busy if gateway else 0,
            tokens_out=gateway.tokens_out if gateway else 0,
            sessions_failed=gateway.sessions_failed if gateway else 0,
            links=links,
        )

    def view(self) -> dict[str, Any]:
        return self.node.discovery.view()


# -- metrics --------------------------------------------------------------------


class _MeshCollector:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def collect(self) -> list[Metric]:
        g = self.backend.gauges()
        out: list[Metric] = []

        def gauge(name: str, doc: str, value: float) -> None:
            out.append(GaugeMetricFamily(name, doc, value=value))

        def counter(name: str, doc: str, value: float) -> None:
            out.append(CounterMetricFamily(name, doc, value=value))

        gauge("hetmesh_ready", "1 when a pipeline of the plan is fully ready", float(g.ready))
        gauge("hetmesh_plan_epoch", "Epoch of the adopted plan (-1: none)", g.plan_epoch)
        gauge("hetmesh_queue_depth", "Steps waiting at this node's stages", g.queue_depth)
        gauge("hetmesh_active_sessions", "Sessions holding KV at this node", g.active_sessions)
        gauge("hetmesh_gateway_sessions", "Sessions this node drives", g.gateway_sessions)
        gauge("hetmesh_kv_bytes_used", "KV cache bytes in use at this node", g.kv_bytes_used)
        gauge("hetmesh_kv_bytes_free", "KV cache bytes still free", g.kv_bytes_free)
        counter("hetmesh_recoveries", "Sessions re-routed after a stage failed", g.recoveries)
        counter("hetmesh_gateway_rejected_busy", "Admissions refused busy", g.rejected_busy)
        counter("hetmesh_tokens_out", "Tokens streamed by this gateway", g.tokens_out)
        counter("hetmesh_sessions_failed", "Sessions that ended in an error", g.sessions_failed)
        bandwidth = GaugeMetricFamily(
            "hetmesh_link_bandwidth_bytes_per_second",
            "Measured bandwidth of a link",
            labels=["src", "dst"],
        )
        rtt = GaugeMetricFamily("hetmesh_link_rtt_seconds", "Measured RTT", labels=["src", "dst"])
        for src, dst, rtt_s, bps in g.links:
            bandwidth.add_metric([src, dst], bps)
            rtt.add_metric([src, dst], rtt_s)
        out += [bandwidth, rtt]
        return out


@dataclass(slots=True)
class ApiMetrics:
    """The API's Prometheus registry: request histograms plus the node's gauges."""

    backend: Backend
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    tpot: Histogram = field(init=False)
    requests: Counter = field(init=False)
    rejected: Counter = field(init=False)
    inflight: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            "hetmesh_ttft_seconds",
            "Time to first token of API requests",
            buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.tpot = Histogram(
            "hetmesh_tpot_seconds",
            "Mean time per output token after the first, per API request",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=r,
        )
        self.requests = Counter(
            "hetmesh_api_requests",
            "API requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "hetmesh_rejected_requests", "API requests refused, by reason", ["reason"], registry=r
        )
        self.inflight = Gauge("hetmesh_api_inflight_requests", "Requests in progress", registry=r)
        r.register(_MeshCollector(self.backend))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -- the app --------------------------------------------------------------------


@dataclass(slots=True)
class _Timing:
    began: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += 1


class _Api:
    def __init__(self, backend: Backend, metrics: ApiMetrics, nursery: trio.Nursery) -> None:
        self.backend = backend
        self.metrics = metrics
        self.nursery = nursery

    # routes

    async def models(self, request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "hetmesh"}
            for m in self.backend.models()
        ]
        return self._json(request, {"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        ready = self.backend.ready()
        body = {"status": "ok" if ready else "starting", "alive": True, "ready": ready}
        return self._json(request, body, 200 if ready else 503)

    async def metrics_route(self, request: Request) -> Response:
        content = await trio.to_thread.run_sync(self.metrics.render)
        return Response(content, media_type=CONTENT_TYPE_LATEST)

    async def status(self, request: Request) -> Response:
        view = json.loads(json.dumps(self.backend.view(), default=str))
        return self._json(request, view)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    # helpers

    def _json(self, request: Request, body: Any, status: int = 200) -> Response:
        self.metrics.requests.labels(request.url.path, str(status)).inc()
        return JSONResponse(body, status_code=status)

    def _error(self, request: Request, err: ApiError) -> Response:
        reason = err.code or err.type
        if err.status >= 400:
            self.metrics.rejected.labels(reason).inc()
        log.info("%s %s -> %d %s", request.method, request.url.path, err.status, err.message)
        return self._json(request, err.body(), err.status)

    async def _parse(self, request: Request, chat: bool) -> tuple[ParsedRequest, list[int], Any]:
        from hetmesh.partition.sampling import SamplingParams

        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="too_large")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
        parsed = parse_request(body, chat=chat, models=self.backend.models())
        ids = await self.backend.encode(parsed)
        context = self.backend.max_context()
        if len(ids) >= context:
            raise _bad(
                f"the prompt has {len(ids)} tokens; the context holds {context}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        room = context - len(ids)
        if parsed.max_tokens is not None and parsed.max_tokens > room:
            raise _bad(
                f"prompt ({len(ids)} tokens) plus max_tokens ({parsed.max_tokens}) exceeds "
                f"the context of {context}",
                "max_tokens",
                "context_length_exceeded",
            )
        default = 16 if not chat else 512
        params = SamplingParams(
            max_new_tokens=parsed.max_tokens or min(default, room),
            temperature=parsed.temperature,
            top_k=parsed.top_k,
            top_p=parsed.top_p,
            seed=parsed.seed,
            stop=parsed.stop,
        )
        return parsed, ids, params

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        timing = _Timing(time.perf_counter())
        try:
            parsed, ids, params = await self._parse(request, chat)
        except ApiError as err:
            return self._error(request, err)
        except MeshError as exc:
            return self._error(request, api_error(exc))
        if parsed.stream:
            return await self._stream(request, parsed, ids, params, timing)
        self.metrics.inflight.inc()
        tokens: list[int] = []
        text: list[str] = []
        try:
            async with contextlib.aclosing(self.backend.stream(ids, params)) as events:
                async for token, delta in events:
                    if token >= 0:
                        tokens.append(token)
                        timing.token()
                    text.append(delta)
        except MeshError as exc:
            return self._error(request, api_error(exc))
        finally:
            self.metrics.inflight.dec()
        self._observe(timing)
        reason = "length" if len(tokens) >= params.max_new_tokens else "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "token_ids": tokens}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice |= {"text": "".join(text), "logprobs": None}
        body = {
            "id": _new_id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": parsed.model,
            "choices": [choice],
            "usage": _usage(len(ids), len(tokens)),
        }
        return self._json(request, body)

    def _observe(self, timing: _Timing) -> None:
        if timing.first is not None:
            self.metrics.ttft.observe(timing.first - timing.began)
        if timing.first is not None and timing.last is not None and timing.tokens > 1:
            self.metrics.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))

    async def _stream(
        self,
        request: Request,
        parsed: ParsedRequest,
        ids: list[int],
        params: SamplingParams,
        timing: _Timing,
    ) -> Response:
        send, receive = trio.open_memory_channel[tuple[str, int, str, MeshError | None]](math.inf)
        scope = trio.CancelScope()
        self.nursery.start_soon(self._produce, ids, params, send, scope)
        self.metrics.inflight.inc()
        try:
            first = await receive.receive()
        except BaseException:
            scope.cancel()
            self.metrics.inflight.dec()
            raise
        if first[0] == "error":
            scope.cancel()
            self.metrics.inflight.dec()
            assert first[3] is not None
            return self._error(request, api_error(first[3]))
        self.metrics.requests.labels(request.url.path, "200").inc()
        body = self._events(parsed, ids, params, first, receive, scope, timing)
        return StreamingResponse(body, media_type="text/event-stream")

    async def _produce(
        self,
        ids: list[int],
        params: SamplingParams,
        send: trio.MemorySendChannel[tuple[str, int, str, MeshError | None]],
        scope: trio.CancelScope,
    ) -> None:
        with scope, send:
            try:
                async with contextlib.aclosing(self.backend.stream(ids, params)) as events:
                    async for token, delta in events:
                        await send.send(("token", token, delta, None))
                await send.send(("done", -1, "", None))
            except MeshError as exc:
                await send.send(("error", -1, "", exc))
            except Exception as exc:
                log.exception("a stream failed")
                await send.send(("error", -1, "", MeshError(f"internal error: {exc}")))

    async def _events(
        self,
        parsed: ParsedRequest,
        ids: list[int],
        params: SamplingParams,
        first: tuple[str, int, str, MeshError | None],
        receive: trio.MemoryReceiveChannel[tuple[str, int, str, MeshError | None]],
        scope: trio.CancelScope,
        timing: _Timing,
    ) -> AsyncIterator[str]:
        chat = parsed.chat
        cid = _new_id(chat)
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            body: dict[str, Any] = {
                "id": cid,
                "object": kind,
                "created": created,
                "model": parsed.model,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def piece(text: str, tokens: list[int], reason: str | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {"index": 0, "finish_reason": reason, "token_ids": tokens}
            if chat:
                out["delta"] = {"content": text} if text or reason is None else {}
            else:
                out |= {"text": text, "logprobs": None}
            return out

        count = 0
        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ]
                )
            item = first
            with receive:
                while True:
                    what, token, delta, exc = item
                    if what == "token":
                        if token >= 0:
                            count += 1
                            timing.token()
                        yield chunk([piece(delta, [token] if token >= 0 else [])])
                    elif what == "done":
                        reason = "length" if count >= params.max_new_tokens else "stop"
                        yield chunk([piece("", [], reason)])
                        if parsed.include_usage:
                            yield chunk([], _usage(len(ids), count))
                        break
                    else:
                        assert exc is not None
                        err = api_error(exc)
                        self.metrics.rejected.labels(err.code or err.type).inc()
                        yield f"data: {json.dumps(err.body())}\n\n"
                        break
                    item = await receive.receive()
            yield "data: [DONE]\n\n"
            self._observe(timing)
        finally:
            scope.cancel()
            self.metrics.inflight.dec()


def _new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def build_app(backend: Backend, metrics: ApiMetrics, nursery: trio.Nursery) -> Starlette:
    """The ASGI app; streams are produced by tasks of ``nursery``."""
    api = _Api(backend, metrics, nursery)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = int(getattr(exc, "status_code", 404))
        err = ApiError(
            status,
            f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
            code="not_found" if status == 404 else "method_not_allowed",
        )
        return api._error(request, err)

    async def crashed(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return api._error(
            request, ApiError(500, f"internal error: {exc}", "server_error", code="internal")
        )

    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/hetmesh/status", api.status, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: crashed}
    )


async def serve_http(
    backend: Backend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API for ``backend`` on ``host:port`` (0: any free port); reports its URL."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hetmesh.node.api.http")  # type: ignore[assignment]
    config.graceful_timeout = 1.0
    metrics = ApiMetrics(backend)
    async with trio.open_nursery() as nursery:
        app = build_app(backend, metrics, nursery)
        binds: list[str] = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=trio.sleep_forever)  # type: ignore[arg-type]
        )
        url = binds[0] if binds else f"http://{host}:{port}"
        log.info("HTTP API on %s", url)
        task_status.started(url)


async def serve_api(
    node: Node,
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The node's OpenAI-compatible API on ``host:port``; never returns."""
    await serve_http(NodeBackend(node), host=host, port=port, task_status=task_status)


__all__ = [
    "ApiError",
    "ApiMetrics",
    "Backend",
    "MeshGauges",
    "NodeBackend",
    "ParsedRequest",
    "api_error",
    "build_app",
    "parse_request",
    "serve_api",
    "serve_http",
]
