"""The HTTP API on its real ASGI stack (Starlette + Hypercorn on trio) with a fake mesh.

The fake backend stands in for the node: it tokenizes by words and "generates"
ids 100, 101, ... so the app's parsing, errors, streaming and metrics can be
tested in-process and fast; the real mesh is tested in tests/integration/api.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel

from hetmesh.errors import NoRoute, Rejected
from hetmesh.node.api_metrics import MeshGauges
from hetmesh.node.api_serve import serve_http
from hetmesh.partition.sampling import SamplingParams
from hetmesh.protocol.generate import GenerateRequest

MODEL = "fake-model"


class FakeBackend:
    def __init__(self) -> None:
        self.is_ready = True
        self.step = trio.Event()  # set: tokens flow freely
        self.step.set()
        self.first_token_free = False  # True: only the tokens after the first wait on step
        self.remotes: dict[str, list[str]] = {}  # model -> peers' APIs (api_forward)

    def models(self) -> list[str]:
        return [MODEL]

    def max_context(self) -> int:
        return 64

    def ready(self) -> bool:
        return self.is_ready

    encoding = 0  # tokenisations running now
    most_encoding = 0
    encoded = 0

    async def encode(self, request: GenerateRequest) -> list[int]:
        self.encoded += 1
        if request.prompt_ids:
            return list(request.prompt_ids)
        text = request.prompt or " ".join(m["content"] for m in request.messages)
        if text.startswith("slowtok"):  # a slow tokenisation: how many run at once?
            self.encoding += 1
            self.most_encoding = max(self.most_encoding, self.encoding)
            try:
                await trio.sleep(0.3)
            finally:
                self.encoding -= 1
        return [len(w) for w in text.split()] or [0]

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        if prompt_ids[0] == len("busy"):
            raise Rejected("busy: every pipeline is full")
        for i in range(params.max_new_tokens):
            if i > 0 or not self.first_token_free:
                await self.step.wait()
            await trio.sleep(0.2 if prompt_ids[0] == len("sluggish") else 0)
            if i == 3 and prompt_ids[0] == len("failing"):
                raise NoRoute("a stage vanished")
            yield 100 + i, f" t{i}"
        yield -1, "."

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [f" t{i - 100}" for i in ids]

    def gauges(self) -> MeshGauges:
        return MeshGauges(
            ready=self.is_ready,
            queue_depth=2,
            active_sessions=1,
            kv_bytes_used=4096,
            links=(("A", "B", 0.001, 1e9),),
            memory_in_use_bytes=612 << 20,
            memory_charged_bytes=215 << 20,
        )

    def view(self) -> dict[str, Any]:
        return {"self": "A", "peers": [{"peer_id": "A", "health": "self", "record": {}}]}

    def for_model(self, model: str) -> Any:
        return self

    def remote_apis(self) -> dict[str, list[str]]:
        return self.remotes


@pytest.fixture
async def api(nursery: trio.Nursery) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend]]:
    backend = FakeBackend()
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield http, backend


async def test_models_health_and_status(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    http, backend = api
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await http.get("/health")).json() == {"status": "ok", "alive": True, "ready": True}
    backend.is_ready = False
    reply = await http.get("/health")
    assert reply.status_code == 503
    assert reply.json()["alive"] is True
    assert (await http.get("/v1/hetmesh/status")).json()["self"] == "A"


async def test_completion_and_chat_with_usage(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    http, _ = api
    body = {"model": MODEL, "prompt": "one two three", "max_tokens": 3}
    reply = (await http.post("/v1/completions", json=body)).json()
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["text"] == " t0 t1 t2."
    assert reply["choices"][0]["token_ids"] == [100, 101, 102]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = (await http.post("/v1/chat/completions", json=chat)).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1."}


async def _events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    async with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_streamed_chat_is_well_formed(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    http, _ = api
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await _events(http, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert ids == [100, 101, 102, 103]
    text = "".join(
        ch["delta"].get("content", "") for c in chunks for ch in c["choices"] if "delta" in ch
    )
    assert text == " t0 t1 t2 t3."
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert reasons == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_an_error_mid_stream_is_an_error_event(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    body = {"model": MODEL, "prompt": "failing", "max_tokens": 8, "stream": True}
    events = await _events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "no_route"
    assert sum(len(c.get("choices", [{}])[0].get("token_ids", [])) for c in events[:-2]) == 3


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{nope", 400, None, "invalid_json"),
        ({"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"prompt": "x"}, 400, "model", None),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
        ({"model": MODEL, "prompt": "w " * 80}, 400, "prompt", "context_length_exceeded"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 64}, 400, "max_tokens", None),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", None),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
        ({"model": MODEL, "prompt": "x", "temperature": 1e-45}, 400, "temperature", None),
        ({"model": MODEL, "prompt": "x", "temperature": 5e-324}, 400, "temperature", None),
        ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed", None),
        ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed", None),
        ({"model": MODEL, "prompt": [5, 2**63]}, 400, "prompt", None),
        ({"model": MODEL, "prompt": [2**64]}, 400, "prompt", None),
        ({"model": MODEL, "prompt": [-1]}, 400, "prompt", None),
        ({"model": MODEL, "prompt": "x", "n": 9}, 400, "n", None),
        ({"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop", None),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", None),
        ({"model": MODEL, "prompt": "busy"}, 429, None, "busy"),
        ([1, 2], 400, None, None),
    ],
)
async def test_bad_completion_requests_get_openai_errors(
    api: tuple[httpx.AsyncClient, FakeBackend],
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    http, _ = api
    if isinstance(body, bytes):
        json_type = {"Content-Type": "application/json"}  # invalid JSON, declared as JSON
        reply = await http.post("/v1/completions", content=body, headers=json_type)
    else:
        reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


async def test_a_busy_mesh_answers_429_before_streaming(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    body = {"model": MODEL, "prompt": "busy", "stream": True}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 429
    assert reply.json()["error"]["hetmesh_error"] == "Rejected"


async def test_unknown_routes_and_methods_are_openai_errors(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    missing = await http.get("/v1/engines")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong = await http.get("/v1/completions")
    assert wrong.status_code == 405


async def test_bad_requests_do_not_disturb_a_running_stream(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, backend = api
    backend.step = trio.Event()  # hold the stream after its first token
    backend.first_token_free = True
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True}
    got: list[Any] = []
    first = trio.Event()

    async def stream() -> None:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    got.append(data if data == "[DONE]" else json.loads(data))
                    first.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        with trio.fail_after(30):
            await first.wait()  # the stream is open and held after its first chunk
        bad = await http.post(
            "/v1/completions", content=b"]", headers={"Content-Type": "application/json"}
        )
        assert bad.status_code == 400
        assert len(got) == 1  # still streaming: nothing after the first chunk yet
        backend.step.set()
    assert got[-1] == "[DONE]"
    assert [t for c in got[:-1] for ch in c["choices"] for t in ch["token_ids"]] == [
        100,
        101,
        102,
        103,
        104,
    ]


async def test_metrics_export_histograms_and_node_gauges(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3})
    await http.post("/v1/completions", json={"model": "nope", "prompt": "a"})
    text = (await http.get("/metrics")).text
    assert "hetmesh_ttft_seconds_count 1.0" in text
    assert "hetmesh_tpot_seconds_count 1.0" in text
    assert "hetmesh_queue_depth 2.0" in text
    assert "hetmesh_kv_bytes_used 4096.0" in text
    assert "hetmesh_memory_in_use_bytes 6.41728512e+08" in text  # 612 MiB
    assert "hetmesh_memory_charged_bytes 2.2544384e+08" in text  # 215 MiB
    assert 'hetmesh_link_bandwidth_bytes_per_second{dst="B",src="A"} 1e+09' in text
    assert 'hetmesh_rejected_requests_total{reason="model_not_found"} 1.0' in text


async def test_sdk_clients_over_http(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    from hetmesh import AsyncClient, Client, InvalidRequest, Rejected

    http, _ = api
    url = str(http.base_url)
    async with AsyncClient(url=url) as client:
        deltas = [d async for d in client.stream("one two", max_new_tokens=3)]
        chat = await client.chat(
            [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
            max_new_tokens=2,
        )
        with pytest.raises(Rejected):
            await client.generate("busy", max_new_tokens=4)
        with pytest.raises(InvalidRequest):
            await client.generate("x", max_new_tokens=64)
    assert [d.token_id for d in deltas] == [100, 101, 102, None]
    assert chat.token_ids == (100, 101)
    assert (chat.prompt_tokens, chat.completion_tokens) == (2, 2)
    assert chat.finish_reason == "length"

    def blocking() -> tuple[list[int | None], str]:
        with Client(url=url) as client:
            ids = [d.token_id for d in client.stream("a", max_new_tokens=2)]
            return ids, client.generate("a b", max_new_tokens=1).text

    ids, text = await trio.to_thread.run_sync(blocking)
    assert ids == [100, 101, None]
    assert text == " t0."


async def test_sdk_timeouts_over_http(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    from hetmesh import AsyncClient, RequestTimeout, Timeout

    http, backend = api
    url = str(http.base_url)
    async with AsyncClient(url=url, timeout=Timeout(first_token=0.5, total=0.5)) as client:
        with pytest.raises(RequestTimeout):  # tokens arrive, but the whole takes too long
            await client.generate("sluggish", max_new_tokens=10)
        backend.step = trio.Event()  # no first token at all
        with pytest.raises(RequestTimeout):
            await client.generate("quick", max_new_tokens=2)
        backend.step.set()
        done = await client.generate("quick", max_new_tokens=2)
    assert done.token_ids == (100, 101)


async def test_a_taken_port_is_one_clear_error(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    from hetmesh.cli.node import first_mesh_error
    from hetmesh.errors import TransportError

    http, backend = api
    port = http.base_url.port
    assert port is not None
    with pytest.raises(BaseException) as caught:  # noqa: PT011 - unwrapped below
        await serve_http(backend, port=port)
    found = first_mesh_error(caught.value)
    assert isinstance(found, TransportError)
    assert f"cannot listen on 127.0.0.1:{port}" in str(found)


async def test_an_api_key_guards_every_route_but_health(nursery: trio.Nursery) -> None:
    from hetmesh import AsyncClient
    from hetmesh.errors import AuthenticationFailed

    backend = FakeBackend()
    url = await nursery.start(
        lambda task_status: serve_http(backend, api_key="s3cret", task_status=task_status)
    )
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (await http.get("/health")).status_code == 200  # load balancers need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = await http.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401
            assert reply.json()["error"]["code"] == "invalid_api_key"
            assert (await http.get("/v1/models", headers=headers)).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        reply = await http.post("/v1/completions", json=body, headers=good)
        assert reply.json()["choices"][0]["token_ids"] == [100, 101]
    async with AsyncClient(url=url, api_key="s3cret") as client:
        assert (await client.generate("one", max_new_tokens=1)).token_ids == (100,)
    with pytest.raises(AuthenticationFailed, match="API key"):
        async with AsyncClient(url=url, api_key="wrong") as client:
            await client.generate("one", max_new_tokens=1)


async def test_the_api_is_not_exposed_beyond_loopback_without_a_key() -> None:
    from hetmesh.cli.node import build_node_config
    from hetmesh.errors import InvalidRequest
    from hetmesh.node.api import check_api_bind

    with pytest.raises(InvalidRequest, match="api-key"):
        await serve_http(FakeBackend(), host="0.0.0.0", port=0)
    with pytest.raises(InvalidRequest, match="api-key"):
        build_node_config({"api_port": 8000, "api_host": "0.0.0.0"})
    for host in ("127.0.0.1", "::1", "localhost"):
        check_api_bind(host, None)
    check_api_bind("0.0.0.0", "a-key")
    config = build_node_config({"api_port": 8000, "api_host": "0.0.0.0", "api_key": "k"})
    assert (config.api_host, config.api_key) == ("0.0.0.0", "k")


def test_an_api_key_without_a_url_is_refused() -> None:
    from hetmesh import AsyncClient
    from hetmesh.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="mesh_secret"):
        AsyncClient("/ip4/127.0.0.1/tcp/1/p2p/QmPeer", api_key="k")


# -- the dashboard: static page, live feed -------------------------------------


async def _sse(reply: httpx.Response, count: int) -> list[tuple[str, Any]]:
    """The first ``count`` server-sent events of a streaming reply, as (event, data)."""
    out: list[tuple[str, Any]] = []
    kind = "message"
    async for line in reply.aiter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
            if len(out) == count:
                break
    return out


async def test_the_dashboard_page_and_its_files_are_served_from_the_package(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    page = await http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    scripts = [
        "/dashboard/main.js",
        "/dashboard/api.js",
        "/dashboard/render.js",
        "/dashboard/charts.js",
        "/dashboard/chat.js",
    ]
    for path in ["/dashboard/dashboard.css", *scripts]:
        reply = await http.get(path)
        assert reply.status_code == 200, path

        assert "http://" not in reply.text.replace("http://www.w3.org/2000/svg", ""), path
        assert "https://" not in reply.text, path
    assert (
        (await http.get("/dashboard/main.js")).headers["content-type"].startswith("text/javascript")
    )
    missing = await http.get("/dashboard/../api.py")
    assert missing.status_code == 404
    assert (await http.get("/dashboard/nope.js")).json()["error"]["code"] == "not_found"


async def test_the_event_stream_says_hello_then_a_snapshot_every_tick(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, _ = api
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 3}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    async with http.stream("GET", "/v1/hetmesh/events") as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = await _sse(reply, 3)
    kinds = [k for k, _ in events]
    assert kinds == ["hello", "snapshot", "snapshot"]
    hello = events[0][1]
    assert hello["interval_s"] == 1.0
    snapshots = [data for kind, data in events[1:]]
    assert all(s["view"]["self"] == "A" for s in snapshots)
    assert snapshots[1]["sample"]["at_s"] > snapshots[0]["sample"]["at_s"]
    # the finished request's TTFT and TPOT reach the series once (in the first tick after it)
    ttfts = [p["ttft_s"] for p in [*hello["series"], *(s["sample"] for s in snapshots)]]
    assert sum(t is not None for t in ttfts) == 1


async def test_with_an_api_key_the_page_is_open_but_its_data_is_not(
    nursery: trio.Nursery,
) -> None:
    backend = FakeBackend()
    url = await nursery.start(
        lambda task_status: serve_http(backend, api_key="s3cret", task_status=task_status)
    )
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert 'id="login"' in page.text
        assert "s3cret" not in page.text
        assert (await http.get("/dashboard/main.js")).status_code == 200
        for path in ("/v1/hetmesh/events", "/v1/hetmesh/status", "/v1/models"):
            reply = await http.get(path)
            assert reply.status_code == 401, path
            assert reply.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer s3cret"}
        async with http.stream("GET", "/v1/hetmesh/events", headers=good) as reply:
            assert reply.status_code == 200
            assert [k for k, _ in await _sse(reply, 1)] == ["hello"]


async def _raw_exchange(url: str, head: bytes, body_chunks: Sequence[bytes]) -> bytes:
    """Send ``head`` and ``body_chunks`` on a plain socket, never finishing the body,
    and return the first bytes the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        answer = bytearray()

        async def read() -> None:
            while b"\r\n" not in answer:
                data = await stream.receive_some(4096)
                if not data:
                    return
                answer.extend(data)

        async with trio.open_nursery() as nursery:

            async def write() -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(head)
                    for chunk in body_chunks:
                        await stream.send_all(chunk)
                    await trio.sleep_forever()  # the rest of the body never comes

            nursery.start_soon(write)
            with trio.fail_after(60):
                await read()
            nursery.cancel_scope.cancel()
    return bytes(answer)


async def test_a_declared_oversized_body_is_refused_before_it_is_read(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    http, backend = api
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    answer = await _raw_exchange(str(http.base_url), head, [b'{"model": '])
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert backend.encoded == 0


async def test_a_streamed_body_is_cut_off_at_the_cap(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    from hetmesh.node.api_requests import MAX_BODY_BYTES

    http, _ = api
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    # one chunk past the cap, then silence: the answer cannot wait for the end
    answer = await _raw_exchange(
        str(http.base_url), head, [chunk] * (MAX_BODY_BYTES // len(piece) + 1)
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer
    # the node keeps serving
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 2}
    assert (await http.post("/v1/completions", json=body)).status_code == 200


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    from hetmesh.node.api_requests import MAX_CHARS_PER_TOKEN

    http, backend = api
    # one "word" to the fake tokenizer, but more characters than 64 tokens can hold
    prompt = "x" * (backend.max_context() * MAX_CHARS_PER_TOKEN + 1)
    reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    reply = await http.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages"
    assert backend.encoded == 0


async def test_tokenisation_runs_a_few_at_a_time(
    api: tuple[httpx.AsyncClient, FakeBackend],
) -> None:
    from hetmesh.node.api import MAX_CONCURRENT_TOKENISATIONS

    http, backend = api
    statuses: list[int] = []

    async def one() -> None:
        body = {"model": MODEL, "prompt": "slowtok two", "max_tokens": 2}
        statuses.append((await http.post("/v1/completions", json=body)).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(one)
    assert statuses == [200] * 6
    assert backend.most_encoding == MAX_CONCURRENT_TOKENISATIONS


async def test_each_client_has_a_bounded_number_of_requests_in_flight(
    nursery: trio.Nursery,
) -> None:
    from hetmesh.node.api import ClientPolicy

    backend = FakeBackend()
    policy = ClientPolicy(max_requests_per_client=2, limit_loopback=True)
    url = await nursery.start(
        lambda task_status: serve_http(backend, policy=policy, task_status=task_status)
    )
    backend.first_token_free = True
    backend.step = trio.Event()  # streams hold after their first token
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with (
            http.stream("POST", "/v1/completions", json=body) as first,
            http.stream("POST", "/v1/completions", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200
            third = await http.post("/v1/completions", json={**body, "stream": False})
            assert third.status_code == 429
            assert third.json()["error"]["code"] == "too_many_requests"
            assert third.json()["error"]["hetmesh_error"] == "Rejected"
            backend.step.set()
            for reply in (first, second):
                assert "[DONE]" in "".join([t async for t in reply.aiter_text()])
        # both slots are free again, the unary path's too
        for _ in range(3):
            reply = await http.post("/v1/completions", json={**body, "stream": False})
            assert reply.status_code == 200


class _EndlessBackend(FakeBackend):
    """Streams as many tokens as asked, counting what it has produced."""

    produced = 0

    def max_context(self) -> int:
        return 1 << 20

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        for i in range(params.max_new_tokens):
            self.produced += 1
            yield 100 + i % 50, " t"
            await trio.lowlevel.checkpoint()


async def test_a_client_that_stops_reading_pauses_its_stream(nursery: trio.Nursery) -> None:
    backend = _EndlessBackend()
    url = await nursery.start(lambda task_status: serve_http(backend, task_status=task_status))
    total = 200_000
    body = {"model": MODEL, "prompt": "one", "max_tokens": total, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        pieces = reply.aiter_raw()  # kept: a dropped iterator would close the response
        await pieces.__anext__()  # one piece, then the client reads no more
        # wait until production stops (or ends): the socket's buffers fill, then the channel's
        seen, still_since = -1, trio.current_time()
        with trio.fail_after(120):
            while backend.produced < total and trio.current_time() - still_since < 1.0:
                if backend.produced != seen:
                    seen, still_since = backend.produced, trio.current_time()
                await trio.sleep(0.05)
        assert backend.produced < total // 2  # held back by the client, not run to the end
