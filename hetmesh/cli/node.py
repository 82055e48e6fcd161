"""``hetmesh node start``: run a node until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path
from typing import Annotated, Any

import trio
import typer

from hetmesh.cli._app import app
from hetmesh.errors import MeshError, find_in_group
from hetmesh.node.config import DEFAULT_SPECULATIVE_K

node_app = typer.Typer(help="Run a mesh node.", no_args_is_help=True)
app.add_typer(node_app, name="node")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def _weights_help() -> str:
    from hetmesh.partition.formats import SLOWER_THAN_FP32_ON_CPU, WeightFormat

    order = [f for f in WeightFormat if f in SLOWER_THAN_FP32_ON_CPU]
    slower = " and ".join(f.value for f in order) or "no format"
    return (
        "Weight format of this node's stages: native (default: the checkpoint's own, int4 "
        "for the default model's Q4_1, float32 for an fp32 folder), float32, bfloat16, "
        "float16, int8, int4 or auto. Compact formats hold about 1/2 (bfloat16, float16), "
        "1/4 (int8) or 1/7 (int4) of float32's weight bytes, and the planner counts each "
        f"node's real bytes. Slower than float32 on a CPU (measured, docs/weights.md): {slower}; "
        "float16 is emulated there; bfloat16 runs about as fast as float32. auto times "
        "one decoder block in each format this device runs and serves the fastest float "
        "format that fits; int8/int4 only if they measure faster or no float format fits. "
        "Exactness: a mesh whose nodes all serve format F gives the tokens of "
        "'hetmesh generate --weights F'; a mesh mixing formats gives those of one process "
        "holding each stage in its node's format (the plan says which), which need not "
        "equal any single-format run."
    )


WEIGHTS_HELP = _weights_help()


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512M"``, ``"1000000"``; ``ValueError`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (try 8GiB, 512M or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def resolve_secret(secret: str | None, secret_file: Path | None) -> str | None:
    if secret_file is not None:
        return secret_file.read_text().strip()
    return secret


def first_mesh_error(exc: BaseException) -> MeshError | None:
    """The first MeshError inside a (possibly nested) exception group."""
    return find_in_group(exc, MeshError)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from hetmesh.discovery.host import configure_libp2p_logging

    configure_libp2p_logging(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger().handlers[0].addFilter(
        lambda r: "Error getting transport addresses" not in r.getMessage()
    )


async def _run_until_signal(
    config: object,
    models: list[str] | None = None,
    memory: dict[str, int] | None = None,
    replicas: dict[str, int] | None = None,
) -> None:
    """Run the node (``models``: several, one member each, :mod:`hetmesh.node.models`);
    the first SIGINT/SIGTERM stops it gracefully, a second one at once."""
    from hetmesh.node.daemon import NodeConfig, run_node
    from hetmesh.node.models import run_models

    assert isinstance(config, NodeConfig)
    log = logging.getLogger("hetmesh.node")
    running: list[Any] = []  # the Node, or the ModelMembers of several models
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def node_main(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                if models:
                    await run_models(
                        config, models, memory, min_replicas=replicas, task_status=task_status
                    )
                else:
                    await run_node(config, task_status=task_status)
                nursery.cancel_scope.cancel()

            async def watch_signals() -> None:
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    if running and not running[0].stop_requested.is_set():
                        running[0].request_stop()
                    else:
                        nursery.cancel_scope.cancel()

            nursery.start_soon(watch_signals)
            running.append(await nursery.start(node_main))


@node_app.command("start")
def start(
    listen: Annotated[
        list[str] | None, typer.Option(help="Multiaddr to listen on (repeatable).")
    ] = None,
    bootstrap: Annotated[
        list[str] | None, typer.Option(help="Peer multiaddr with /p2p/ID (repeatable).")
    ] = None,
    mesh_secret: Annotated[
        str | None, typer.Option(envvar="HETMESH_MESH_SECRET", help="Shared secret of the mesh.")
    ] = None,
    mesh_secret_file: Annotated[
        Path | None, typer.Option(help="File holding the mesh secret.")
    ] = None,
    no_mdns: Annotated[
        bool | None, typer.Option("--no-mdns", help="Do not use mDNS discovery.")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Identity and caches live here.")] = None,
    max_memory: Annotated[
        str | None, typer.Option(help="Cap the memory this node offers, e.g. 8GiB.")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Only offer this torch device (cpu, cuda:0).")
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="Model to serve: the default name, a HF folder, a .gguf file, a synth "
            "name (synth-llama-3.2-1b...: random weights, its text is noise), or "
            "'mesh' / a manifest id to fetch it from the mesh's peers. Repeatable: "
            "several models are served side by side (one mesh member each, the memory "
            "split among them; see --model-memory), the API routing by 'model'."
        ),
    ] = None,
    model_memory: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=SIZE (repeatable): the memory one of several --model's members "
            "offers, e.g. synth-llama-3.2-1b=2GiB; the others split the rest of "
            "--max-memory (or of the machine's) evenly."
        ),
    ] = None,
    min_replicas: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=N (repeatable): keep at least N members of one of several --model's "
            "on this node, each with its memory share. What no share takes (give every "
            "model a --model-memory) is placed by demand: a model whose recent requests "
            "and queue per member grow gets another member, an idle one gives it back."
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(envvar="HETMESH_HOME", help="Model cache directory.")
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(envvar="HETMESH_WEIGHTS", help=WEIGHTS_HELP),
    ] = None,
    serve: Annotated[
        bool | None,
        typer.Option("--serve/--no-serve", help="Serve the model (default) or only join."),
    ] = None,
    relay: Annotated[
        bool | None,
        typer.Option(
            "--relay/--no-relay",
            help="While publicly reachable, relay for members behind NAT (default) or not.",
        ),
    ] = None,
    objective: Annotated[
        str | None, typer.Option(help="Plan for: latency (default) or throughput.")
    ] = None,
    plan_strategy: Annotated[
        str | None,
        typer.Option(
            help="hetmesh (default), or force a baseline: even, memory-proportional, "
            "greedy (benchmarks)."
        ),
    ] = None,
    max_context: Annotated[
        int | None, typer.Option(help="Longest context (tokens) a session may reach.")
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(
            help="Cap on concurrent sessions per stage; the planner budgets KV memory for "
            "this many full-context sessions. Default: it budgets 8 and stages admit by "
            "KV blocks alone (short sessions share the pool)."
        ),
    ] = None,
    kv_pool_tokens: Annotated[
        int | None,
        typer.Option(
            envvar="HETMESH_KV_POOL_TOKENS",
            help="Tokens of KV cache each stage's pool holds (16-token blocks). Default: "
            "the KV memory the planner budgets, max-context x max-sessions (8 if unset).",
        ),
    ] = None,
    prefix_cache: Annotated[
        bool | None,
        typer.Option(
            "--prefix-cache/--no-prefix-cache",
            help="Requests entering here reuse the KV of prompt prefixes the stages hold "
            "(default), or always prefill their whole prompt (for comparisons).",
        ),
    ] = None,
    migrate: Annotated[
        bool | None,
        typer.Option(
            "--migrate/--no-migrate",
            help="A request entering here whose stage leaves alive (re-plan, a node "
            "stopping) moves with its KV (default), or replays its history (for comparisons).",
        ),
    ] = None,
    speculative: Annotated[
        bool | None,
        typer.Option(
            "--speculative/--no-speculative",
            help="Requests entering here send drafts (prompt lookup, or --draft) with "
            "their decode steps, verified by the last stage: several tokens per trip "
            "through the pipeline, the same output. A budget measures each session's "
            f"steps and sends 0 to {DEFAULT_SPECULATIVE_K} drafts a step, none where "
            "they do not pay (a probe of one draft in 16 steps). On by default; "
            "--no-speculative: plain decoding.",
        ),
    ] = None,
    speculative_k: Annotated[
        int | None,
        typer.Option(
            "--speculative-k",
            help="Drafts every decode step of a request entering here sends, fixed (for "
            "comparisons; 0: none, the default). With --speculative: the budget's most.",
        ),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(
            "--draft",
            help="What drafts with --speculative[-k]: 'lookup' (prompt lookup, the "
            "default) or a weight format such as 'int4': a copy of the served model in "
            "that format at this node, drafting for its requests (its memory is this "
            "node's: the int4 default model ~124 MB).",
        ),
    ] = None,
    kv_reserve_whole: Annotated[
        bool | None,
        typer.Option(
            "--kv-reserve-whole",
            hidden=True,
            help="Admit sessions the old way, reserving prompt + max tokens of KV up "
            "front (bench/kv.py compares it with paged admission).",
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="Torch threads of this node (default: the cores it may use, cgroup quota "
            "and affinity included; nodes sharing a host should split them)."
        ),
    ] = None,
    block_step_ms: Annotated[
        float | None,
        typer.Option(
            help="Skip the startup calibration and announce this decode step time of one "
            "decoder block, in ms (like Petals' --throughput): for equal machines, or a "
            "figure measured at a quiet moment."
        ),
    ] = None,
    require_encryption: Annotated[
        bool | None,
        typer.Option("--require-encryption", help="Data plane over encrypted libp2p only."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="TOML file with the same keys as the flags.")
    ] = None,
    verbose: Annotated[bool | None, typer.Option("--verbose", "-v")] = None,
    api_port: Annotated[
        int | None,
        typer.Option(help="Serve the OpenAI-compatible HTTP API on PORT (0: any free port)."),
    ] = None,
    api_host: Annotated[
        str | None,
        typer.Option(
            help="Address the HTTP API listens on (default 127.0.0.1); beyond loopback "
            "it needs --api-key."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="HETMESH_API_KEY",
            help="Require 'Authorization: Bearer KEY' on the HTTP API (what the openai "
            "package sends as its api_key).",
        ),
    ] = None,
) -> None:
    """Run a node: discovery, profiling, and its share of serving the model."""
    given = {k: v for k, v in locals().items() if v is not None and k != "config"}
    from hetmesh.node.config import check_settings, load_config_file, merge

    flags = check_settings(
        {k: str(v) if isinstance(v, Path) else v for k, v in given.items()}, source="flags"
    )
    settings = merge(flags, load_config_file(config) if config is not None else {})
    setup_logging(bool(settings.get("verbose")))
    node_config = build_node_config(settings)
    if node_config.serving is not None:
        limit_cpu_threads(node_config.serving.threads)
    models = serving_models(settings)
    try:
        if node_config.serving is not None and len(models) > 1:
            memory = parse_model_memory(settings.get("model_memory") or [])
            replicas = parse_min_replicas(settings.get("min_replicas") or [])
            trio.run(_run_until_signal, node_config, models, memory, replicas)
        else:
            trio.run(_run_until_signal, node_config)
    except BaseExceptionGroup as group:
        found = first_mesh_error(group)
        if found is None:
            raise
        raise found from None
    logging.getLogger("hetmesh.node").info("stopped")


def limit_cpu_threads(threads: int) -> None:
    """Cap OpenMP/MKL at ``threads`` before torch loads.

    ``torch.set_num_threads`` binds only the calling thread's OpenMP team: the
    device worker thread would otherwise run a team as wide as the machine, and
    several nodes on one host then fight over the cores (and spin-wait).
    """
    import os
    import sys

    if "torch" in sys.modules:
        return  # too late for the environment; the device thread sets its own count
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(threads))


def build_node_config(settings: dict[str, Any]) -> Any:
    """A NodeConfig from merged settings (flags, environment, file)."""
    from hetmesh.errors import InvalidRequest
    from hetmesh.node.config import STOP_DRAIN_S, ServingConfig, default_threads
    from hetmesh.node.daemon import NodeConfig, default_data_dir

    def path(key: str) -> Path | None:
        value = settings.get(key)
        return Path(value).expanduser() if value is not None else None

    max_memory = settings.get("max_memory")
    try:
        max_bytes = parse_size(str(max_memory)) if max_memory is not None else None
    except ValueError as exc:
        raise InvalidRequest(f"--max-memory: {exc}") from exc
    for key in ("max_context", "max_sessions", "kv_pool_tokens", "threads"):
        value = settings.get(key)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    block_step_ms = settings.get("block_step_ms")
    if block_step_ms is not None and not 0 < block_step_ms < 1e6:
        raise InvalidRequest(f"--block-step-ms must be a positive time, got {block_step_ms}")
    serving = None
    if settings.get("serve", True):
        base = ServingConfig()
        models = serving_models(settings)
        serving = ServingConfig(
            model=models[0] if models else None,
            weights=_weights(settings.get("weights"), settings.get("device")),
            cache_dir=path("cache_dir"),
            objective=settings.get("objective") or base.objective,
            plan_strategy=settings.get("plan_strategy") or base.plan_strategy,
            max_context_tokens=settings.get("max_context") or base.max_context_tokens,
            max_sessions=settings.get("max_sessions") or base.max_sessions,
            kv_pool_tokens=settings.get("kv_pool_tokens") or base.kv_pool_tokens,
            prefix_cache=bool(settings.get("prefix_cache", base.prefix_cache)),
            migrate=bool(settings.get("migrate", base.migrate)),
            speculative_k=_speculative_k(settings),
            speculative_measured=_speculative_measured(settings),
            draft=_draft(settings.get("draft")),
            drain_s=STOP_DRAIN_S,  # SIGTERM: sessions move away before the node leaves
            kv_reserve_whole=bool(settings.get("kv_reserve_whole", base.kv_reserve_whole)),
            threads=settings.get("threads") or default_threads(),
            block_step_s=None if block_step_ms is None else block_step_ms / 1e3,
            require_encryption=bool(settings.get("require_encryption")),
            backends=tuple(settings.get("backends") or base.backends),
        )
    secret_file = path("mesh_secret_file")
    api_host = str(settings.get("api_host") or "127.0.0.1")
    api_key = settings.get("api_key") or None
    mesh_secret = resolve_secret(settings.get("mesh_secret"), secret_file)
    if settings.get("api_port") is not None:
        from hetmesh.node.api import check_api_bind
        from hetmesh.node.api_guard import check_client_key

        check_api_bind(api_host, api_key)
        check_client_key(api_key, mesh_secret)
    return NodeConfig(
        listen=tuple(settings.get("listen") or ("/ip4/0.0.0.0/tcp/0",)),
        bootstrap=tuple(settings.get("bootstrap") or ()),
        mesh_secret=mesh_secret,
        mdns=not settings.get("no_mdns"),
        data_dir=path("data_dir") or default_data_dir(),
        max_memory_bytes=max_bytes,
        device=settings.get("device"),
        serving=serving,
        api_port=_api_port(settings.get("api_port")),
        api_host=api_host,
        api_key=api_key,
        relay=bool(settings.get("relay", True)),
    )


def serving_models(settings: dict[str, Any]) -> list[str]:
    """The ``model`` setting as a list: a flag's repeats, or a file's string or list."""
    value = settings.get("model")
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def parse_model_memory(items: list[str]) -> dict[str, int]:
    """``--model-memory NAME=SIZE`` items as bytes by model name."""
    from hetmesh.errors import InvalidRequest

    out: dict[str, int] = {}
    for item in items:
        name, sep, size = item.partition("=")
        if not sep or not name:
            raise InvalidRequest(f"--model-memory {item!r}: expected NAME=SIZE, e.g. a=2GiB")
        try:
            out[name] = parse_size(size)
        except ValueError as exc:
            raise InvalidRequest(f"--model-memory {item!r}: {exc}") from exc
    return out


def parse_min_replicas(items: list[str]) -> dict[str, int]:
    """``--min-replicas NAME=N`` items as members by model name."""
    from hetmesh.errors import InvalidRequest

    out: dict[str, int] = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or not name or not count.strip().isdigit():
            raise InvalidRequest(f"--min-replicas {item!r}: expected NAME=N, e.g. a=2")
        out[name] = int(count)
    return out


def _speculative_k(settings: dict[str, Any]) -> int:
    """Drafts per decode step from ``--speculative[-k]`` (``--no-speculative`` wins)."""
    from hetmesh.errors import InvalidRequest
    from hetmesh.transport.frames import MAX_DRAFTS

    if settings.get("speculative") is False:
        return 0
    k = settings.get("speculative_k")
    if k is None:  # on by default: the measured budget's most
        return DEFAULT_SPECULATIVE_K
    if not 0 <= k <= MAX_DRAFTS:
        raise InvalidRequest(f"--speculative-k must be within [0, {MAX_DRAFTS}], got {k}")
    return int(k)


def _speculative_measured(settings: dict[str, Any]) -> bool:
    """Whether the measured budget chooses: unless ``--no-speculative`` or a
    ``--speculative-k`` (a k given is every step's, for comparisons)."""
    return settings.get("speculative") is not False and settings.get("speculative_k") is None


def _draft(value: Any) -> str:
    """``--draft``: ``lookup``, or a weight format (checked here, before the node joins)."""
    from hetmesh.partition.formats import parse_weights
    from hetmesh.speculative.choose import LOOKUP

    if value is None or str(value).strip().lower() == LOOKUP:
        return LOOKUP
    fmt = parse_weights(str(value))
    if fmt is None:  # "auto"
        from hetmesh.errors import InvalidRequest

        raise InvalidRequest("--draft takes 'lookup' or a weight format, not 'auto'")
    return fmt.value


def _weights(value: Any, device: Any) -> str:
    """The --weights setting, checked against the device before the node joins."""
    from hetmesh.node.weights import check_weights
    from hetmesh.partition.formats import NATIVE

    if value is None:
        return NATIVE
    return check_weights(str(value), str(device or "cpu")) or "auto"


def _api_port(value: Any) -> int | None:
    from hetmesh.errors import InvalidRequest

    if value is not None and not 0 <= int(value) <= 65535:
        raise InvalidRequest(f"--api-port must be a port number (0-65535), got {value}")
    return None if value is None else int(value)
