"""The node's HTTP API: OpenAI-compatible completions, health, Prometheus metrics.

```
serve_api(NodeBackend(discovery, serving), port)   api_serve.py, started by run_node
└── serve_http(backend)
    ├── hypercorn (trio worker)        Starlette app: /v1/models, /v1/completions,
    │                                  /v1/chat/completions, /health, /metrics,
    │                                  /v1/hetmesh/status, the dashboard (/, /dashboard/*,
    │                                  /v1/hetmesh/events: hetmesh.node.dashboard)
    ├── Feed.run                       the dashboard's live feed (hetmesh.node.events)
    └── one producer task per stream   drives Serving.stream into a memory channel
```

Requests enter the mesh at this node (it is their gateway). With an API key
(``--api-key``), every route but ``/health`` and the dashboard's static files
wants ``Authorization: Bearer KEY`` (what the ``openai`` package sends) and
answers 401 without it; a node refuses to serve the API beyond loopback
without a key, and without one answers only requests naming this machine in
``Host`` with no other site's ``Origin`` (403 otherwise:
:mod:`hetmesh.node.api_guard`). Request bodies must be sent as
``application/json`` (415 otherwise). Errors are OpenAI-shaped, ``{"error": {"message", "type",
"param", "code"}}``, with a 4xx status for the client's mistakes and
429/503/504 for a busy or broken mesh; the error's hetmesh class travels as
``error.hetmesh_error`` so the SDK raises the same exception a libp2p client
would. Streams (``"stream": true``) are
server-sent events ending with ``data: [DONE]``; every chunk's choice carries
the hetmesh extension ``token_ids``.

Nothing a client sends is held whole before it is bounded: the body is read
as a stream and refused with 413 once it passes :data:`MAX_BODY_BYTES` (or
at once when its declared length does); a prompt longer than the context
could hold is refused before it is tokenised, and tokenisation runs off the
event loop, a few at a time; each client address may have
``max_requests_per_client`` completions in flight (429 past that; loopback
clients, the node's own machine, are not counted unless asked), and each API
key ``max_requests_per_key``, from whatever address (429 past that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hetmesh import errors
from hetmesh.error_codec import error_name
from hetmesh.errors import MeshError
from hetmesh.node.api_choices import Choice, Event, Timing, choice_params, produce
from hetmesh.node.api_forward import Forward, check_forward, forward
from hetmesh.node.api_guard import (
    LocalGuard,
    LocalOnly,
    RequireKey,
    check_api_bind,
    redacted_view,
    route_label,
)
from hetmesh.node.api_metrics import ApiMetrics, MeshGauges
from hetmesh.node.api_models import ModelControl, model_routes
from hetmesh.node.api_requests import (
    DEFAULT_MAX_REQUESTS_PER_CLIENT,
    DEFAULT_MAX_REQUESTS_PER_KEY,
    MAX_BODY_BYTES,
    ApiError,
    ApiRequest,
    ClientLimits,
    api_error,
    bad_request,
    check_json_body,
    check_prompt_chars,
    default_max_tokens,
    parse_api_request,
)
from hetmesh.node.api_stream import HeldStream, choice_body, new_id, next_event, sse_events, usage
from hetmesh.node.api_structured import schema_grammar, tools_grammar
from hetmesh.node.dashboard import dashboard_routes
from hetmesh.node.events import Feed
from hetmesh.protocol.generate import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# -- what the app needs from a node ---------------------------------------------


class Backend(Protocol):
    """The node as the app sees it; :class:`hetmesh.node.backend.NodeBackend` implements
    it over a running node, a fake stands in for it in unit tests.

    ``models``: the model names served; ``max_context``: tokens a request may hold
    (prompt and completion); ``ready``: whether a request could enter the mesh now;
    ``encode``: a request's prompt token ids (``InvalidRequest`` for a malformed
    conversation, ``NoRoute`` when nothing is served); ``stream``: ``(token id, text)``
    pairs (id -1 for a final text-only flush), raising from the error tree;
    ``token_texts``: each token id's own text (the log-probabilities' ``token``);
    ``gauges``/``view``: what ``/metrics`` and ``/v1/hetmesh/status`` show;
    ``for_model``: the backend serving one of ``models`` (a request routes by its
    ``model``; ``ModelNotFound`` for another); ``remote_apis``: the peers' APIs a
    request for a model not served here is forwarded to (:mod:`.api_forward`).
    """

    def models(self) -> list[str]: ...
    def max_context(self) -> int: ...
    def ready(self) -> bool: ...
    async def encode(self, request: GenerateRequest) -> list[int]: ...
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]: ...
    def token_texts(self, ids: Sequence[int]) -> list[str]: ...
    def gauges(self) -> MeshGauges: ...
    def view(self) -> dict[str, Any]: ...
    def for_model(self, model: str) -> Backend: ...
    def remote_apis(self) -> dict[str, list[str]]: ...


# -- the app --------------------------------------------------------------------


MAX_CONCURRENT_TOKENISATIONS = 2  # the rest wait, off the event loop's worker threads
STREAM_BUFFER = 64  # tokens a stream's producer may run ahead of its client


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientPolicy:
    """How much of the API one client may take: completions in flight per address
    (``limit_loopback``: count loopback clients too; off, the node's own machine
    is trusted as its operator), and per API key when the API wants one (every
    address counted: a key shared or leaked cannot take every session)."""

    max_requests_per_client: int = DEFAULT_MAX_REQUESTS_PER_CLIENT
    limit_loopback: bool = False
    max_requests_per_key: int = DEFAULT_MAX_REQUESTS_PER_KEY


class _Api:
    def __init__(
        self,
        backend: Backend,
        metrics: ApiMetrics,
        nursery: trio.Nursery,
        feed: Feed,
        policy: ClientPolicy | None = None,
        *,
        keyed: bool = False,
        forward_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.forward_token = forward_token  # what a request forwarded from here presents
        self.metrics = metrics
        self.nursery = nursery
        self.feed = feed
        self.policy = policy or ClientPolicy()
        self.clients = ClientLimits(self.policy.max_requests_per_client)
        self.keyed = keyed  # the API wants a key (checked before a route runs)
        self.keys = ClientLimits(self.policy.max_requests_per_key)
        self.tokenising = trio.CapacityLimiter(MAX_CONCURRENT_TOKENISATIONS)
        self.routes: Sequence[Route] = ()  # set by build_app: the labels metrics may use

    # routes

    async def models(self, request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "hetmesh"}
            for m in dict.fromkeys([*self.backend.models(), *self.backend.remote_apis()])
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
        view = json.loads(json.dumps(redacted_view(self.backend.view()), default=str))
        return self._json(request, view)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    # helpers

    def route_label(self, request: Request) -> str:
        """The metrics label of ``request``'s route: its template, or ``unmatched``.

        Never the raw path: a stranger's requests to distinct paths (each answered 401
        or 404) would otherwise each add a labelled series, growing /metrics and memory.
        """
        return route_label(request.url.path, self.routes)

    def _json(self, request: Request, body: object, status: int = 200) -> Response:
        self.metrics.requests.labels(self.route_label(request), str(status)).inc()
        return JSONResponse(body, status_code=status)

    def _error(self, request: Request, err: ApiError) -> Response:
        reason = err.code or err.type
        if err.status >= 400:
            self.metrics.rejected.labels(reason).inc()
        log.info("%s %s -> %d %s", request.method, request.url.path, err.status, err.message)
        return self._json(request, err.body(), err.status)

    async def _body(self, request: Request) -> bytes:
        """The body, read as a stream and refused (413) the moment it passes the cap."""
        too_large = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large  # without reading a byte of it
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        return bytes(raw)

    async def _parse(
        self, request: Request, chat: bool
    ) -> tuple[ApiRequest, list[int], SamplingParams, Backend]:
        check_json_body(request.headers.get("content-type"))
        raw = await self._body(request)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
        check_forward(request, body, raw, self.backend.models(), self.backend.remote_apis())
        parsed = parse_api_request(body, chat=chat, models=self.backend.models())
        backend = self.backend.for_model(parsed.model)  # requests route by model
        context = backend.max_context()
        check_prompt_chars(parsed.request, context)  # before the tokenizer reads it
        async with self.tokenising:
            ids = await backend.encode(parsed.request)  # the backend runs it in a thread
        if len(ids) >= context:
            raise bad_request(
                f"the prompt has {len(ids)} tokens; the context holds {context}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        room = context - len(ids)
        if parsed.max_tokens is not None and parsed.max_tokens > room:
            raise bad_request(
                f"prompt ({len(ids)} tokens) plus max_tokens ({parsed.max_tokens}) exceeds "
                f"the context of {context}",
                "max_tokens",
                "context_length_exceeded",
            )
        params = parsed.request.sampling
        if parsed.max_tokens is None:
            params = dataclasses.replace(params, max_new_tokens=default_max_tokens(chat, room))
        if parsed.schema is not None:  # response_format: a grammar for the last stage
            params = dataclasses.replace(params, grammar=await schema_grammar(parsed.schema))
        elif parsed.tools is not None:  # what tool_choice lets the model write
            params = dataclasses.replace(params, grammar=await tools_grammar(parsed.tools))
        return parsed, ids, params, backend

    def _client(self, request: Request) -> str | None:
        """The key a request counts against (its peer address); None: not counted."""
        host = request.client.host if request.client is not None else ""
        if not self.policy.limit_loopback:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(host).is_loopback:
                    return None
        return host

    def _key(self, request: Request) -> str | None:
        """The API key a request counts against (a digest, never the key); None: no key."""
        if not self.keyed:
            return None
        given = request.headers.get("authorization", "")
        return hashlib.sha256(given.encode()).hexdigest()[:32]

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        client, key = self._client(request), self._key(request)
        refused = ""
        if client is not None and not self.clients.acquire(client):
            refused = f"this client already has {self.clients.per_client} requests in flight"
        elif key is not None and not self.keys.acquire(key):
            if client is not None:
                self.clients.release(client)
            refused = f"this API key already has {self.keys.per_client} requests in flight"
        if refused:
            return self._error(
                request,
                ApiError(
                    429,
                    f"{refused}; wait for one to end",
                    "rate_limit_error",
                    code="too_many_requests",
                    hetmesh_error=error_name(errors.Rejected),
                ),
            )
        release = self._releaser(client, key)
        try:
            response = await self._complete_held(request, chat, release)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()
        return response  # a stream releases its slot when it ends

    def _releaser(self, client: str | None, key: str | None) -> Callable[[], None]:
        """Releases ``client``'s and ``key``'s slots once, however many times it is called."""
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            if client is not None:
                self.clients.release(client)
            if key is not None:
                self.keys.release(key)

        return release

    async def _complete_held(
        self, request: Request, chat: bool, release: Callable[[], None]
    ) -> Response:
        timing = Timing(time.perf_counter())
        try:
            try:
                parsed, ids, params, backend = await self._parse(request, chat)
            except Forward as fwd:  # a model another node serves
                return await forward(request, fwd, release, self.forward_token)
        except ApiError as err:
            return self._error(request, err)
        except MeshError as exc:
            return self._error(request, api_error(exc))
        # bounded: a client that stops reading pauses its generation instead of
        # letting the producer pile up every token it has not read
        send, receive = trio.open_memory_channel[Event](STREAM_BUFFER)
        scope = trio.CancelScope()
        choices_params = choice_params(params, parsed.n)
        self.nursery.start_soon(self._produce, backend, ids, choices_params, send, scope)
        self.metrics.inflight.inc()
        try:
            first = await receive.receive()
        except BaseException:
            scope.cancel()
            self.metrics.inflight.dec()
            raise
        if first.what == "error":
            scope.cancel()
            self.metrics.inflight.dec()
            assert first.error is not None
            return self._error(request, api_error(first.error))
        if parsed.stream:
            self.metrics.requests.labels(self.route_label(request), "200").inc()
            events = self._events(
                backend, parsed, ids, params, first, receive, scope, timing, release
            )
            return HeldStream(events, release, media_type="text/event-stream")
        choices = [Choice() for _ in range(parsed.n)]
        try:
            with receive:
                event: Event | None = first
                while event is not None:
                    if event.what == "error":
                        assert event.error is not None
                        return self._error(request, api_error(event.error))
                    if event.what == "token":
                        choices[event.index].add(event.token, event.text)
                        if event.token >= 0:
                            timing.token()
                    event = await next_event(receive)
        finally:
            scope.cancel()
            self.metrics.inflight.dec()
        self._observe(timing)
        body = {
            "id": new_id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": parsed.model,
            "choices": [
                choice_body(parsed, params.max_new_tokens, i, c, backend.token_texts)
                for i, c in enumerate(choices)
            ],
            "usage": usage(len(ids), sum(len(c.tokens) for c in choices)),
        }
        return self._json(request, body)

    def _observe(self, timing: Timing) -> None:
        ttft = tpot = None
        if timing.first is not None:
            ttft = timing.first - timing.began
            self.metrics.ttft.observe(ttft)
        if timing.first is not None and timing.last is not None and timing.tokens > 1:
            tpot = (timing.last - timing.first) / (timing.tokens - 1)
            self.metrics.tpot.observe(tpot)
        self.feed.observe(ttft, tpot)

    async def _produce(
        self,
        backend: Backend,
        ids: list[int],
        params: list[SamplingParams],
        send: trio.MemorySendChannel[Event],
        scope: trio.CancelScope,
    ) -> None:
        with scope:
            await produce(backend.stream, ids, params, send)

    async def _events(
        self,
        backend: Backend,
        parsed: ApiRequest,
        ids: list[int],
        params: SamplingParams,
        first: Event,
        receive: trio.MemoryReceiveChannel[Event],
        scope: trio.CancelScope,
        timing: Timing,
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        def rejected(err: ApiError) -> None:
            self.metrics.rejected.labels(err.code or err.type).inc()

        try:
            lines = sse_events(
                parsed,
                len(ids),
                params.max_new_tokens,
                first,
                receive,
                backend.token_texts,
                on_token=timing.token,
                on_error=rejected,
            )
            async for line in lines:
                yield line
            self._observe(timing)
        finally:
            scope.cancel()
            self.metrics.inflight.dec()
            release()


def build_app(
    backend: Backend,
    metrics: ApiMetrics,
    nursery: trio.Nursery,
    *,
    api_key: str | None = None,
    feed: Feed | None = None,
    policy: ClientPolicy | None = None,
    guard: LocalGuard | None = None,
    models: ModelControl | None = None,
    forward_token: str | None = None,
) -> Starlette:
    """The ASGI app; streams are produced by tasks of ``nursery``.

    Without a ``feed`` the app makes one and ticks it in ``nursery``. Without an
    ``api_key`` the app answers only requests that name ``guard``'s hosts (loopback
    by default) and carry no other site's Origin.
    """
    if feed is None:
        feed = Feed(lambda: redacted_view(backend.view()))  # no prompt hashes
        nursery.start_soon(feed.run)
    api = _Api(
        backend, metrics, nursery, feed, policy, keyed=bool(api_key), forward_token=forward_token
    )

    def unauthorized(request: Request) -> Response:
        err = ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            hetmesh_error=error_name(errors.AuthenticationFailed),
        )
        return api._error(request, err)

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
        *dashboard_routes(feed, api._error),
        *(model_routes(models, api._error) if models is not None else ()),  # several models
    ]
    api.routes = routes

    def foreign(request: Request, why: str) -> Response:
        return api._error(request, ApiError(403, why, code="foreign_origin"))

    if api_key:
        middleware = [
            Middleware(RequireKey, key=api_key, reject=unauthorized, forwarded=forward_token)
        ]
    else:
        guard = guard or LocalGuard()
        middleware = [Middleware(LocalOnly, guard=guard, reject=foreign)]
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={404: not_found, 405: not_found, Exception: crashed},
    )


__all__ = [
    "ApiError",
    "ApiMetrics",
    "ApiRequest",
    "Backend",
    "ClientPolicy",
    "LocalGuard",
    "MeshGauges",
    "api_error",
    "build_app",
    "check_api_bind",
    "parse_api_request",
    "route_label",
]
