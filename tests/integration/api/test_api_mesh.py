"""The HTTP API and the SDK against one real three-node mesh (shared with test_mesh_serving.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.api.api_mesh import SECRET, Mesh

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The three primary colours are"
CHAT = "Name a large animal."
TOKENS = 12


@pytest.fixture
def mesh(shared_mesh3: Mesh) -> Mesh:
    """Three nodes, the first with the API: shared with test_mesh_serving.py."""
    return shared_mesh3


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> dict[str, list[int]]:
    """Single-process greedy token ids for PROMPT (plain) and CHAT (chat template); the
    pipeline is the one test_mesh_serving.py's references use (loaded once)."""
    from tests.integration.api.api_mesh import WEIGHTS
    from tests.integration.node.mesh_nodes import encode, reference_ids

    out = {}
    for key, text, chat in (("plain", PROMPT, False), ("chat", CHAT, True)):
        ids = encode(default_model_dir, text, chat=chat)
        out[key] = reference_ids(default_model_dir, ids, TOKENS, WEIGHTS)
    return out


def model_id(mesh: Mesh) -> str:
    return str(httpx.get(f"{mesh.api_url}/v1/models").json()["data"][0]["id"])


def test_openai_package_lists_completes_and_streams_a_chat(
    mesh: Mesh, reference: dict[str, list[int]]
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{mesh.api_url}/v1", api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list()]
    assert models == ["smollm2-135m-instruct"]
    completion = client.completions.create(
        model=models[0], prompt=PROMPT, max_tokens=TOKENS, temperature=0
    )
    assert completion.choices[0].text.strip()
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(reference["plain"])
    assert completion.choices[0].model_extra["token_ids"] == reference["plain"]

    stream = client.chat.completions.create(
        model=models[0],
        messages=[{"role": "user", "content": CHAT}],
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    ids: list[int] = []
    reasons: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            ids += (choice.model_extra or {}).get("token_ids") or []
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert ids == reference["chat"]
    assert "".join(pieces).strip()
    assert len(reasons) == 1
    assert reasons[0] in ("stop", "length")
    assert usage is not None
    assert usage.completion_tokens == len(ids)
    assert usage.prompt_tokens > 0


def test_blocking_client_streams_the_reference_tokens(
    mesh: Mesh, reference: dict[str, list[int]]
) -> None:
    from hetmesh import Client, Timeout

    with Client(bootstrap=mesh.addr, mesh_secret=SECRET, timeout=Timeout(total=120)) as client:
        deltas = list(client.stream(PROMPT, max_new_tokens=TOKENS))
        completion = client.chat([{"role": "user", "content": CHAT}], max_new_tokens=TOKENS)
        view = client.status()
    assert [d.token_id for d in deltas if d.token_id is not None] == reference["plain"]
    assert completion.token_ids == tuple(reference["chat"])
    assert completion.completion_tokens == len(reference["chat"])
    assert len(view["peers"]) == 3


def test_blocking_client_over_http_streams_the_reference_tokens(
    mesh: Mesh, reference: dict[str, list[int]]
) -> None:
    from hetmesh import Client

    with Client(url=mesh.api_url) as client:
        ids = [d.token_id for d in client.stream(PROMPT, max_new_tokens=TOKENS) if d.token_id]
        completion = client.generate(PROMPT, max_new_tokens=TOKENS)
        assert len(client.status()["peers"]) == 3
    assert ids == reference["plain"]
    assert completion.token_ids == tuple(reference["plain"])
    assert completion.prompt_tokens > 0
    assert completion.finish_reason in ("stop", "length")


async def test_async_client_streams_the_reference_tokens(
    mesh: Mesh, reference: dict[str, list[int]]
) -> None:
    from hetmesh import AsyncClient

    async with AsyncClient(mesh.addr, mesh_secret=SECRET) as client:
        ids = [d.token_id async for d in client.stream(PROMPT, max_new_tokens=TOKENS)]
        chat = await client.chat([{"role": "user", "content": CHAT}], max_new_tokens=TOKENS)
    assert [i for i in ids if i is not None] == reference["plain"]
    assert list(chat.token_ids) == reference["chat"]


async def test_async_client_reports_a_bad_request_from_the_node(mesh: Mesh) -> None:
    from hetmesh import AsyncClient, InvalidRequest

    async with AsyncClient(mesh.addr, mesh_secret=SECRET) as client:
        with pytest.raises(InvalidRequest, match="context"):
            await client.generate("word " * 3000, max_new_tokens=4)
        completion = await client.generate(PROMPT, max_new_tokens=3)  # still serving
    assert completion.completion_tokens == 3


def _long_stream(url: str, model: str, out: dict[str, Any]) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 60, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        out["status"] = reply.status_code
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                out.setdefault("started", threading.Event()).set()
    out["events"] = events


def test_bad_requests_get_openai_errors_while_a_stream_runs(mesh: Mesh) -> None:
    model = model_id(mesh)
    out: dict[str, Any] = {"started": threading.Event()}
    worker = threading.Thread(target=_long_stream, args=(mesh.api_url, model, out))
    worker.start()
    try:
        assert out["started"].wait(60), "the stream never started"
        url = f"{mesh.api_url}/v1/completions"
        bad = [
            (
                httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
                None,
            ),
            (httpx.post(url, json={"model": "no-such-model", "prompt": "hi"}), "model"),
            (
                httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": -5}),
                "max_tokens",
            ),
            (httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": 0}), "max_tokens"),
            (
                httpx.post(url, json={"model": model, "prompt": "word " * 3000}, timeout=30),
                "prompt",
            ),
            (
                httpx.post(url, json={"model": model, "prompt": "hi", "temperature": -1}),
                "temperature",
            ),
            (
                httpx.post(
                    f"{mesh.api_url}/v1/chat/completions",
                    json={"model": model, "messages": [{"role": "robot", "content": 1}]},
                ),
                "messages",
            ),
        ]
        for reply, param in bad:
            assert 400 <= reply.status_code < 500, reply.text
            error = reply.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["message"]
            assert error["param"] == param
        assert bad[1][0].status_code == 404
        assert bad[4][0].json()["error"]["code"] == "context_length_exceeded"
        assert worker.is_alive(), "the stream should still be running"
    finally:
        worker.join(120)
    assert out["status"] == 200
    events = out["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert len(tokens) == 60 or chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # and the server still answers afterwards
    assert httpx.get(f"{mesh.api_url}/health").json()["ready"] is True


def test_metrics_and_health(mesh: Mesh) -> None:
    model = model_id(mesh)
    reply = httpx.post(
        f"{mesh.api_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200
    health = httpx.get(f"{mesh.api_url}/health").json()
    assert health == {"status": "ok", "alive": True, "ready": True}
    text = httpx.get(f"{mesh.api_url}/metrics").text
    for name in (
        "hetmesh_ttft_seconds_bucket",
        "hetmesh_tpot_seconds_count",
        "hetmesh_queue_depth",
        "hetmesh_active_sessions",
        "hetmesh_kv_bytes_used",
        "hetmesh_link_bandwidth_bytes_per_second{",
        "hetmesh_recoveries_total",
        "hetmesh_rejected_requests_total",
        'hetmesh_kv_blocks{stage="',  # per stage served here: in use / free / cached
        "hetmesh_prefix_cache_hit_rate{",
        "hetmesh_kv_preemptions_total{",
    ):
        assert name in text, name
    count = [ln for ln in text.splitlines() if ln.startswith("hetmesh_ttft_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


def test_status_cli_against_the_live_mesh(mesh: Mesh) -> None:
    import subprocess
    import sys

    from tests.integration.discovery.discovery_nodes import REPO, node_env

    base = [sys.executable, "-m", "hetmesh", "status", "--mesh", mesh.addr, "--mesh-secret", SECRET]
    plain = subprocess.run(
        [*base, "--width", "200"],
        capture_output=True,
        text=True,
        env=node_env(),
        cwd=str(REPO),
        timeout=60,
    )
    assert plain.returncode == 0, plain.stderr
    out = plain.stdout
    assert "plan epoch" in out
    assert "bottleneck" in out
    assert out.count("alive") >= 2
    assert "tokens/s" in out
    raw = subprocess.run(
        [*base, "--json"],
        capture_output=True,
        text=True,
        env=node_env(),
        cwd=str(REPO),
        timeout=60,
        check=True,
    )
    view = json.loads(raw.stdout)
    assert len(view["peers"]) == 3
    assert len(view["summary"]["plan"]["pipelines"][0]["stages"]) == 3
    assert sum(s["bottleneck"] for s in view["summary"]["plan"]["pipelines"][0]["stages"]) == 1

    import signal

    watching = subprocess.Popen(
        [*base, "--watch", "--interval", "0.5", "--width", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=node_env(),
        cwd=str(REPO),
    )
    try:
        seen = ""
        assert watching.stdout is not None
        end = time.monotonic() + 60
        while time.monotonic() < end and seen.count("plan epoch") < 2:
            line = watching.stdout.readline()
            if not line:
                break
            seen += line
        assert seen.count("plan epoch") >= 2, seen  # drawn, then redrawn (piped: appended)
        watching.send_signal(signal.SIGINT)
        assert watching.wait(timeout=20) == 0
    finally:
        if watching.poll() is None:
            watching.kill()
            watching.wait()


def test_generate_cli_streams_from_the_mesh(
    mesh: Mesh, reference: dict[str, list[int]], default_model_dir: Path
) -> None:
    import subprocess
    import sys

    from hetmesh.partition.text import load_tokenizer
    from tests.integration.discovery.discovery_nodes import REPO, node_env

    argv = [
        sys.executable,
        "-m",
        "hetmesh",
        "generate",
        PROMPT,
        "--max-new-tokens",
        str(TOKENS),
        "--mesh",
        mesh.addr,
        "--mesh-secret",
        SECRET,
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, env=node_env(), cwd=str(REPO), timeout=90
    )
    assert done.returncode == 0, done.stderr
    expected = load_tokenizer(default_model_dir).decode(
        reference["plain"], skip_special_tokens=True
    )
    assert done.stdout.rstrip("\n") == expected
