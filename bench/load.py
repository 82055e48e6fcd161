"""Load test: concurrent streaming clients against a three-node mesh's HTTP API.

Starts three node processes on loopback serving the default model (memory
capped so the planner must cut it into ``--stages`` stages, 3 by default:
bench/cut.py computes the cap from the model's bytes as shipped; the run fails
unless the adopted plan has that many stages, and prints it; the first node
serves the OpenAI-compatible API), then runs ``--clients`` concurrent clients for
``--duration`` seconds. Each client streams one chat or text completion after
another (``stream: true``, greedy, ``--max-tokens`` tokens) and checks every
stream: each event is JSON, token ids arrive one per token, exactly one
``finish_reason``, usage counts match, and ``data: [DONE]`` ends it.

    .venv/bin/python bench/load.py                 # 32 clients, 60 s, a table
    .venv/bin/python bench/load.py --json          # one JSON object
    .venv/bin/python bench/load.py --url http://127.0.0.1:8000   # an existing API
    .venv/bin/python bench/load.py --chat / --structured   # chats, plain / JSON-schema output
    .venv/bin/python bench/load.py --compare-structured --clients 4 --duration 15 --max-tokens 24

Keys: ``errors`` (failed or malformed streams), ``streams``, ``tokens``,
``ttft_p50_s``/``ttft_p99_s`` (request sent → first token), ``tpot_p50_s``/
``tpot_p99_s`` (per stream: (last token − first token) / (tokens − 1)),
``tokens_per_s`` (all tokens of completed streams ÷ wall time), ``plan`` (each
pipeline's stages as (node, start, end)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

REPO = Path(__file__).resolve().parents[1]
SECRET = "bench-load-secret"
# text prompts that the model continues (an instruction without the chat template
# often gets an immediate end-of-sequence); every fourth request is a chat
PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "The history of the printing press begins",
    "Copper is a metal that is used for",
    "The three primary colours are",
    "A good cup of tea is made by",
    "Octopuses are remarkable animals because",
)
CHATS = (
    "Write a short poem about the sea.",
    "Explain what a pipeline is in one paragraph.",
    "Describe a sunrise over the mountains.",
)


@dataclass
class Results:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: int = 0
    streams: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_mesh(workdir: Path, *, sessions: int, memory: str, context: int) -> Iterator[str]:
    """Three loopback node processes; yields the first node's API URL once it is ready."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("HETMESH_MESH_SECRET", None)
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    flags = [
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--mesh-secret",
        SECRET,
        "--max-memory",
        memory,
        "--max-sessions",
        str(sessions),
        "--max-context",
        str(context),
    ]

    def start(name: str, *extra: str) -> Path:
        data = workdir / name
        data.mkdir(parents=True, exist_ok=True)
        log = (workdir / f"{name}.log").open("wb")
        argv = [sys.executable, "-m", "hetmesh", "node", "start", "--data-dir", str(data)]
        procs.append(
            subprocess.Popen([*argv, *flags, *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
        )
        return data / "node.json"

    def wait(what: str, check: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise SystemExit(f"a node exited with {p.returncode}; logs in {workdir}")
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise SystemExit(f"timed out waiting for {what}; logs in {workdir}")

    def ready(url: str) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        info = start("node0", "--api-port", str(port))
        wait("node0", info.exists, 120)
        addr = json.loads(info.read_text())["addrs"][0]
        for i in (1, 2):
            start(f"node{i}", "--bootstrap", addr)
        url = f"http://127.0.0.1:{port}"
        wait("a ready pipeline", lambda: ready(url), 180)
        yield url
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --structured: every request a chat whose answer must follow this schema (a grammar on
# the last stage); --chat: the same chats without it, the baseline to compare with
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["answer", "facts"],
    "additionalProperties": False,
}
MODE = {"chat": False, "structured": False}


async def one_stream(
    http: httpx.AsyncClient, model: str, index: int, max_tokens: int, results: Results
) -> None:
    # one request in four is a chat (its template adds ~30 tokens), unless --chat/--structured
    chat = index % 4 == 0 or MODE["chat"] or MODE["structured"]
    prompt = CHATS[index % len(CHATS)] if chat else PROMPTS[index % len(PROMPTS)]
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    if MODE["structured"]:
        schema = {"name": "answer", "schema": SCHEMA, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    began = time.perf_counter()
    stamps: list[float] = []
    finishes: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    try:
        if not chat:
            body["prompt"] = prompt
        async with http.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                results.fail(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
                return
            async for line in reply.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    results.fail(f"not an event line: {line[:80]!r}")
                    return
                data = line[6:]
                if done:
                    results.fail("an event after [DONE]")
                    return
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    results.fail(f"error event: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    now = time.perf_counter()
                    stamps += [now] * len(choice.get("token_ids") or ())
                    if choice.get("finish_reason"):
                        finishes.append(choice["finish_reason"])
    except (httpx.HTTPError, ValueError) as exc:
        results.fail(f"{type(exc).__name__}: {exc}")
        await trio.sleep(0.5)  # the node may be gone: do not spin
        return
    if not done:
        results.fail("the stream ended without [DONE]")
    elif len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        results.fail(f"finish reasons {finishes}")
    elif usage is None or usage.get("completion_tokens") != len(stamps):
        results.fail(f"usage {usage} against {len(stamps)} token ids")
    elif finishes[0] == "length" and len(stamps) != max_tokens:
        results.fail(f"{len(stamps)} tokens with finish_reason {finishes[0]}")
    else:
        results.streams += 1
        results.tokens += len(stamps)
        if stamps:
            results.ttft_s.append(stamps[0] - began)
        if len(stamps) > 1:
            results.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))


async def drive(
    url: str, clients: int, duration_s: float, max_tokens: int, ramp_s: float
) -> dict[str, Any]:
    results = Results()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        warm = Results()  # page the weights in before the clock starts
        for i in range(2):
            await one_stream(http, model, i, 4, warm)
        if warm.errors:
            raise SystemExit(f"the warm-up request failed: {warm.error_samples}")
        began = time.perf_counter()
        deadline = began + duration_s

        async def client(k: int) -> None:
            await trio.sleep(ramp_s * k / clients)  # clients join over ramp_s seconds
            i = k
            while time.perf_counter() < deadline:
                await one_stream(http, model, i, max_tokens, results)
                i += clients

        async with trio.open_nursery() as nursery:
            for k in range(clients):
                nursery.start_soon(client, k)
        wall = time.perf_counter() - began
    return {
        "clients": clients,
        "duration_s": round(wall, 2),
        "max_tokens": max_tokens,
        "ramp_s": ramp_s,
        "streams": results.streams,
        "errors": results.errors,
        "error_samples": results.error_samples,
        "tokens": results.tokens,
        "tokens_per_s": round(results.tokens / wall, 2),
        "ttft_p50_s": _pct(results.ttft_s, 50),
        "ttft_p99_s": _pct(results.ttft_s, 99),
        "tpot_p50_s": _pct(results.tpot_s, 50),
        "tpot_p99_s": _pct(results.tpot_s, 99),
    }


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(p / 100 * len(ordered)) - 1)
    return round(ordered[rank], 4)


def memory_for(stages: int, sessions: int, context: int) -> str:
    """Each node's --max-memory: the model needs ``stages`` nodes."""
    import cut  # bench/cut.py, beside this file

    from hetmesh.partition.store import resolve_model

    cap = cut.memory_cap(
        resolve_model(), "native", stages, max_context=context, max_sessions=sessions
    )
    return str(cap)


def settled_plan(url: str, stages: int, timeout_s: float = 180.0) -> Any:
    """The adopted plan once every pipeline of it has ``stages`` stages; fails (with the
    plan) if it does not come to that."""
    import cut

    from hetmesh.scheduler.replan import newest_in_view

    deadline = time.monotonic() + timeout_s
    plan = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            plan = newest_in_view(httpx.get(f"{url}/v1/hetmesh/status", timeout=10).json())
            if plan is not None and cut.every_pipeline_has(stages)(plan):
                return plan
        time.sleep(0.5)
    cut.require_plan(plan, f"a {stages}-stage cut", cut.every_pipeline_has(stages))
    return plan


def compare_structured(url: str, args: argparse.Namespace) -> int:
    """Plain chats against JSON-schema chats, alternating on one mesh (so both phases
    see the same machine): one JSON line per phase, then each round's ratio, their
    median, and the ratio of all the rounds' tokens/s together."""
    rows = []
    for round_ in range(args.rounds):
        for mode in ("chat", "structured"):
            MODE.update(chat=mode == "chat", structured=mode == "structured")
            report = trio.run(drive, url, args.clients, args.duration, args.max_tokens, args.ramp)
            keys = ("errors", "streams", "tokens", "tokens_per_s", "tpot_p50_s", "ttft_p50_s")
            row = {"mode": mode, "round": round_, **{k: report[k] for k in keys}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    ratios = []
    for plain, structured in zip(rows[::2], rows[1::2], strict=True):
        ratio = structured["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
        ratios.append(ratio)
        print(f"round {plain['round']}: structured/plain tokens/s = {ratio:.2f}")
    total = {
        m: sum(r["tokens_per_s"] for r in rows if r["mode"] == m) for m in ("chat", "structured")
    }
    print(
        f"median of {len(ratios)} rounds: {statistics.median(ratios):.2f}; "
        f"all rounds together: {total['structured'] / max(total['chat'], 1e-9):.2f}"
    )
    return 1 if any(r["errors"] or not r["streams"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--ramp", type=float, default=15.0, help="seconds over which the clients join"
    )
    parser.add_argument("--url", help="an existing node API instead of a local mesh")
    parser.add_argument("--sessions", type=int, default=32, help="--max-sessions of each node")
    parser.add_argument("--max-context", type=int, default=256, help="--max-context of each node")
    parser.add_argument(
        "--memory", default="", help="--max-memory of each node (default: for --stages)"
    )
    parser.add_argument("--stages", type=int, default=3, help="the cut the mesh must have")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--chat", action="store_true", help="every request a chat")
    parser.add_argument(
        "--structured", action="store_true", help="every request a chat with a JSON schema"
    )
    parser.add_argument(
        "--compare-structured",
        action="store_true",
        help="on one mesh: --chat, then --structured, --rounds times; each phase "
        "--duration seconds",
    )
    parser.add_argument("--rounds", type=int, default=2, help="--compare-structured's rounds")
    args = parser.parse_args(argv)
    MODE.update(chat=args.chat, structured=args.structured)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            import cut  # bench/cut.py, beside this file

            workdir = Path(tempfile.mkdtemp(prefix="hetmesh-load-"))  # node logs stay there
            memory = args.memory or memory_for(args.stages, args.sessions, args.max_context)
            url = stack.enter_context(
                local_mesh(workdir, sessions=args.sessions, memory=memory, context=args.max_context)
            )
            adopted = settled_plan(url, args.stages)
            print(f"plan: {cut.describe(adopted)}", file=sys.stderr, flush=True)
            plan = httpx.get(f"{url}/v1/hetmesh/status", timeout=10).json()
        else:
            plan = None
        if args.compare_structured:
            return compare_structured(url, args)
        report = trio.run(drive, url, args.clients, args.duration, args.max_tokens, args.ramp)
        if plan is not None:
            stages = sorted(
                (s["start"], s["end"])
                for p in plan["peers"]
                for s in p["record"].get("stages") or ()
                if s.get("ready")
            )
            report["mesh_stages"] = [list(s) for s in stages]
            report["plan"] = cut.describe(adopted)
            report["logs"] = str(workdir)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>14}: {value}")
    return 1 if report["errors"] or not report["streams"] else 0


if __name__ == "__main__":
    sys.exit(main())
