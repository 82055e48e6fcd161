"""The SDK: :class:`AsyncClient` for trio programs, :class:`Client` for scripts and notebooks.

```python
from hetmesh import Client, Timeout

with Client(bootstrap="/ip4/10.0.0.2/tcp/4001/p2p/12D3...", mesh_secret="s") as mesh:
    print(mesh.generate("The capital of France is", max_new_tokens=8).text)
    for delta in mesh.stream("Once upon a time", max_new_tokens=32):
        print(delta.text, end="", flush=True)
```

A client reaches the mesh in one of three ways: ``url`` (a node's
OpenAI-compatible HTTP API, with its ``api_key``: a client's own credential,
which lets it generate and read status and nothing else), ``bootstrap``
multiaddrs (it dials the first that answers, over libp2p with the mesh
secret), or ``mdns=True`` (it listens for a node on the LAN, with the secret).
The mesh secret is a member's credential: whoever holds it can also announce,
gossip and sign, so give those who may only ask for completions a URL and an
API key. The mesh routes each request from the node it enters at.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import trio

from hetmesh.client._base import (
    Completion,
    Delta,
    Finish,
    Message,
    SamplingOptions,
    Timeout,
    collect,
    decode_sse_chunk,
    generate_request,
    http_error,
    seconds,
)
from hetmesh.errors import (
    ConnectTimeout,
    InvalidRequest,
    LocalProtocolError,
    MeshError,
    NoRoute,
    PeerUnreachable,
    RemoteProtocolError,
    RequestTimeout,
)

T = TypeVar("T")


class _HttpTransport:
    """Requests through a node's HTTP API (OpenAI-style, with hetmesh's token ids)."""

    def __init__(self, url: str, timeout: Timeout, api_key: str | None = None) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.timeout = timeout
        self._model: str | None = None
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeout=httpx.Timeout(
                connect=timeout.connect,
                read=timeout.first_token,
                write=timeout.connect,
                pool=timeout.connect,
            ),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def check(self) -> None:
        import httpx

        try:
            reply = await self._http.get("/health")
        except httpx.TimeoutException as exc:
            raise ConnectTimeout(f"{self.url} did not answer in time") from exc
        except httpx.HTTPError as exc:
            raise PeerUnreachable(f"cannot reach {self.url}: {exc}") from exc
        if reply.status_code >= 500 and reply.status_code != 503:
            raise PeerUnreachable(f"{self.url}/health answered {reply.status_code}")

    async def model(self) -> str:
        """The id of the model the node serves (asked once)."""
        if self._model is None:
            reply = await self._get("/v1/models")
            data = reply.get("data") or []
            if not data:
                raise NoRoute(f"{self.url} serves no model yet")
            self._model = str(data[0]["id"])
        return self._model

    async def _get(self, path: str) -> dict[str, Any]:
        import httpx

        try:
            reply = await self._http.get(path)
        except httpx.HTTPError as exc:
            raise PeerUnreachable(f"{self.url}{path}: {exc}") from exc
        body = reply.json()
        if reply.status_code >= 400:
            raise http_error(reply.status_code, body)
        if not isinstance(body, dict):
            raise RemoteProtocolError(f"{self.url}{path} answered a non-object")
        return body

    async def status(self) -> dict[str, Any]:
        return await self._get("/v1/hetmesh/status")

    async def deltas(
        self, body: dict[str, Any], *, chat: bool, limits: Timeout
    ) -> AsyncGenerator[Delta | Finish, None]:
        import httpx

        timeout = limits
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        deadline = trio.current_time() + seconds(timeout.total)
        reason = ""
        try:
            async with self._http.stream("POST", path, json=body) as reply:
                if reply.status_code >= 400:
                    raw = await reply.aread()
                    try:
                        payload = json.loads(raw)
                    except ValueError:
                        payload = None
                    raise http_error(reply.status_code, payload)
                lines = reply.aiter_lines()
                while True:
                    with trio.move_on_at(deadline) as scope:
                        line = await anext(lines, None)
                    if scope.cancelled_caught:
                        raise RequestTimeout(f"the stream took longer than {timeout.total} s")
                    if line is None:
                        raise RemoteProtocolError("the event stream ended without [DONE]")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise RemoteProtocolError(f"bad event {data[:80]!r}") from exc
                    for event in decode_sse_chunk(chunk):
                        if isinstance(event, Finish):
                            if event.prompt_tokens < 0:
                                reason = event.finish_reason
                                continue
                            event = Finish(reason, event.prompt_tokens, event.completion_tokens)
                        yield event
        except httpx.TimeoutException as exc:
            raise RequestTimeout(f"{self.url}{path}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise PeerUnreachable(f"{self.url}{path}: {exc}") from exc


class AsyncClient:
    """A trio client of a mesh; use as ``async with AsyncClient(...) as client:``.

    Methods raise from :mod:`hetmesh.errors`: ``InvalidRequest`` for bad input,
    ``Rejected`` when the mesh is busy, ``NoRoute`` when nothing serves the
    model, ``RequestTimeout`` past a :class:`Timeout`, ``ConnectTimeout`` /
    ``PeerUnreachable`` / ``AuthenticationFailed`` when the mesh cannot be reached.
    """

    def __init__(
        self,
        bootstrap: str | Sequence[str] = (),
        *,
        url: str | None = None,
        mdns: bool = False,
        mesh_secret: str | None = None,
        timeout: Timeout | None = None,
        api_key: str | None = None,
    ) -> None:
        self._bootstrap = [bootstrap] if isinstance(bootstrap, str) else list(bootstrap)
        self._api_key = api_key
        ways = bool(self._bootstrap) + (url is not None) + bool(mdns)
        if ways != 1:
            raise InvalidRequest("give exactly one of bootstrap=, url= or mdns=True")
        if api_key and url is None:
            raise InvalidRequest(
                "api_key= is for a node's HTTP API (url=); the mesh uses mesh_secret="
            )
        self._url = url
        self._mdns = mdns
        self._secret = mesh_secret
        self.timeout = timeout or Timeout()
        self._stack: contextlib.AsyncExitStack | None = None
        self._mesh: Any = None  # hetmesh.client.mesh.MeshClient
        self._http: _HttpTransport | None = None

    async def __aenter__(self) -> AsyncClient:
        if self._stack is not None:
            raise LocalProtocolError("this client is already open")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            if self._url is not None:
                self._http = _HttpTransport(self._url, self.timeout, self._api_key)
                stack.push_async_callback(self._http.aclose)
                with trio.fail_after(seconds(self.timeout.connect)):
                    await self._http.check()
            else:
                from hetmesh.client.mesh import discover_mdns, open_mesh_client

                addrs = self._bootstrap
                if self._mdns:
                    found = await discover_mdns(
                        self._secret, timeout_s=min(seconds(self.timeout.connect), 30.0)
                    )
                    addrs = [found]
                self._mesh = await stack.enter_async_context(
                    open_mesh_client(addrs, mesh_secret=self._secret, limits=self.timeout)
                )
        except trio.TooSlowError as exc:
            await stack.aclose()
            raise ConnectTimeout(
                f"could not reach the mesh within {self.timeout.connect} s"
            ) from exc
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        stack, self._stack = self._stack, None
        self._mesh = self._http = None
        if stack is not None:
            await stack.aclose()

    def _check_open(self) -> None:
        if self._stack is None:
            raise LocalProtocolError("use the client inside 'async with' (it is not open)")

    async def _events(
        self, prompt: str | Sequence[Message], chat: bool, sampling: dict[str, Any]
    ) -> AsyncGenerator[Delta | Finish, None]:
        self._check_open()
        timeout = sampling.pop("timeout", None) or self.timeout
        options = SamplingOptions.of(**sampling)
        if self._http is not None:
            body: dict[str, Any] = {"model": await self._http.model(), **options.to_openai()}
            if chat:
                body["messages"] = [dict(m) for m in prompt if not isinstance(m, str)]
            else:
                body["prompt"] = prompt
            async with contextlib.aclosing(
                self._http.deltas(body, chat=chat, limits=timeout)
            ) as events:
                async for event in events:
                    yield event
            return
        if not chat and not isinstance(prompt, str):
            raise InvalidRequest("the prompt must be a string")
        async with contextlib.aclosing(
            self._mesh.deltas(generate_request(prompt, options, chat=chat), timeout)
        ) as events:
            async for event in events:
                yield event

    async def stream(self, prompt: str, **sampling: Any) -> AsyncIterator[Delta]:
        """Text deltas with their token ids as they are generated (``async for``)."""
        async with contextlib.aclosing(self._events(prompt, False, sampling)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    yield event

    async def stream_chat(
        self, messages: Sequence[Message], **sampling: Any
    ) -> AsyncIterator[Delta]:
        """Like :meth:`stream`, for a chat (``[{"role": "user", "content": ...}]``)."""
        async with contextlib.aclosing(self._events(messages, True, sampling)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    yield event

    async def _complete(
        self, prompt: str | Sequence[Message], chat: bool, sampling: dict[str, Any]
    ) -> Completion:
        deltas: list[Delta] = []
        finish: Finish | None = None
        async with contextlib.aclosing(self._events(prompt, chat, sampling)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    deltas.append(event)
                else:
                    finish = event
        return collect(deltas, finish)

    async def generate(self, prompt: str, **sampling: Any) -> Completion:
        """The whole completion of ``prompt``. Sampling: ``max_new_tokens``,
        ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, and ``timeout``."""
        return await self._complete(prompt, False, sampling)

    async def chat(self, messages: Sequence[Message], **sampling: Any) -> Completion:
        """The assistant's reply to ``messages``, through the model's chat template."""
        return await self._complete(messages, True, sampling)

    async def status(self) -> dict[str, Any]:
        """The entry node's view of the mesh (what ``hetmesh status --json`` prints)."""
        self._check_open()
        if self._http is not None:
            return await self._http.status()
        status: dict[str, Any] = await self._mesh.status(seconds(self.timeout.connect))
        return status


_DONE = object()


class Client:
    """The blocking client: the same methods as :class:`AsyncClient`, without ``await``.

    It runs one trio loop in a background thread for its whole life, so the
    libp2p host, its connection to the mesh and the HTTP connection pool are
    set up once and reused by every call (a fresh ``trio.run`` per call would
    redo the handshake each time), and it works where the calling thread
    already runs an event loop (a notebook). Use it as a context manager or
    call :meth:`close`.
    """

    def __init__(
        self,
        bootstrap: str | Sequence[str] = (),
        *,
        url: str | None = None,
        mdns: bool = False,
        mesh_secret: str | None = None,
        timeout: Timeout | None = None,
        api_key: str | None = None,
    ) -> None:
        self._async = AsyncClient(
            bootstrap,
            url=url,
            mdns=mdns,
            mesh_secret=mesh_secret,
            timeout=timeout,
            api_key=api_key,
        )
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetmesh-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with self._async, trio.open_nursery() as nursery:
                self._nursery = nursery
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # a connect failure: report its first MeshError
            self._failure = _first(group)
            raise
        except BaseException as exc:
            self._failure = exc
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the background loop (idempotent)."""
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if not self._thread.is_alive():
            raise LocalProtocolError("this client is closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def generate(self, prompt: str, **sampling: Any) -> Completion:
        """See :meth:`AsyncClient.generate`."""
        return self._call(lambda: self._async.generate(prompt, **sampling))

    def chat(self, messages: Sequence[Message], **sampling: Any) -> Completion:
        """See :meth:`AsyncClient.chat`."""
        return self._call(lambda: self._async.chat(messages, **sampling))

    def status(self) -> dict[str, Any]:
        """See :meth:`AsyncClient.status`."""
        return self._call(self._async.status)

    def stream(self, prompt: str, **sampling: Any) -> Iterator[Delta]:
        """See :meth:`AsyncClient.stream`; stopping early (``break``) cancels the request."""
        return self._iterate(lambda: self._async.stream(prompt, **sampling))

    def stream_chat(self, messages: Sequence[Message], **sampling: Any) -> Iterator[Delta]:
        """See :meth:`AsyncClient.stream_chat`."""
        return self._iterate(lambda: self._async.stream_chat(messages, **sampling))

    def _iterate(self, make: Callable[[], AsyncIterator[Delta]]) -> Iterator[Delta]:
        items: queue.Queue[Any] = queue.Queue()
        scope = trio.CancelScope()

        async def produce() -> None:
            with scope:
                try:
                    agen = make()
                    async with contextlib.aclosing(agen):  # type: ignore[type-var]
                        async for delta in agen:
                            items.put(delta)
                except MeshError as exc:
                    items.put(exc)
                except Exception as exc:
                    items.put(MeshError(f"{type(exc).__name__}: {exc}"))
            items.put(_DONE)

        def start() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(produce)

        if not self._thread.is_alive():
            raise LocalProtocolError("this client is closed")
        trio.from_thread.run_sync(start, trio_token=self._token)
        try:
            while True:
                item = items.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self._thread.is_alive():
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(scope.cancel, trio_token=self._token)


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        found: BaseException = exc
        return found
    return group


__all__ = ["AsyncClient", "Client"]
