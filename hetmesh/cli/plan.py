"""``hetmesh plan``: the placement the scheduler would choose, beside the baselines'.

The inputs are either a JSON file of devices (and optional links) or a live mesh
(any node's address: its status view gives the devices and the measured links).
Loading, planning and rendering are separate pure functions, tested without a
mesh.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table

from hetmesh.cli._app import app
from hetmesh.cli.devices_file import HELP as DEVICES_HELP
from hetmesh.cli.devices_file import json_schema, parse_entries
from hetmesh.errors import InsufficientCapacity, MeshError, ModelNotFound
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler import BASELINES, Plan, PlanConstraints, plan
from hetmesh.scheduler.announcement import read_serving
from hetmesh.scheduler.records import Objective

_LIVE = ("self", "alive", "suspect")


def load_config(spec: str) -> tuple[dict[str, Any], str]:
    """The config mapping and name of a known shape or a model folder / ``config.json``."""
    from hetmesh.partition.profile import KNOWN_SHAPES

    if spec in KNOWN_SHAPES:
        return dict(KNOWN_SHAPES[spec]), spec
    from hetmesh.partition.synth import is_synth_name, parse_synth_name, synth_config

    if is_synth_name(spec):  # its shape is known without writing it
        return synth_config(parse_synth_name(spec).shape), spec
    path = Path(spec)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        known = ", ".join(sorted(KNOWN_SHAPES))
        raise ModelNotFound(f"{spec}: neither a known shape ({known}) nor a model folder")
    return json.loads(config.read_text()), path.name if path.is_dir() else spec


def load_model(spec: str, dtype: str) -> ModelProfile:
    """A known shape's name (``llama-7b``…) or a model folder / ``config.json`` path."""
    from hetmesh.partition.profile import model_profile

    config, name = load_config(spec)
    return model_profile(config, weights=dtype, name=name)


def with_weights(
    constraints: PlanConstraints,
    config: Mapping[str, Any],
    name: str,
    devices: Sequence[DeviceProfile],
    weights: Mapping[str, str],
) -> PlanConstraints:
    """``constraints`` charging each device the bytes of its peer's format (``weights``:
    peer id → format; peers not named are planned in the model profile's format)."""
    from hetmesh.node.weights import weight_bytes, weights_constraints
    from hetmesh.partition.formats import parse_weights

    def bytes_of(fmt: str) -> Any:
        parsed = parse_weights(fmt)
        return None if parsed is None else weight_bytes(config, parsed.value, name=name)

    announced = [(peer, {"weights": fmt}) for peer, fmt in sorted(weights.items())]
    return weights_constraints(constraints, announced, devices, bytes_of)


def weights_in(data: Any) -> dict[str, str]:
    """Peer id → weight format, from a devices file's entries (``"weights"`` key) or a
    status view's peers (their announced ``extra["weights"]``)."""
    out: dict[str, str] = {}
    if isinstance(data, dict) and isinstance(data.get("peers"), list):
        for peer in data["peers"]:
            announced = read_serving((peer.get("record") or {}).get("extra"), plan_of=None)
            if announced.weights:
                out[str(peer.get("peer_id"))] = announced.weights
        return out
    entries = data if isinstance(data, list) else (data or {}).get("devices") or []
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("weights"), str):
            out[str(entry.get("peer_id"))] = entry["weights"]
    return out


def parse_devices(data: Any) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """A list of DeviceProfile wire maps, or ``{"devices": [...], "links": [...]}``; a
    ValueError names the entry and field at fault (:mod:`hetmesh.cli.devices_file`)."""
    return parse_entries(data)


def _print_schema(value: bool) -> None:
    if value:
        typer.echo(json.dumps(json_schema(), indent=1))
        raise typer.Exit()


def devices_from_view(view: Mapping[str, Any]) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """The live peers' devices and the links of a status view (``hetmesh status --json``)."""
    devices: list[DeviceProfile] = []
    live: set[str] = set()
    for peer in view.get("peers", []):
        if str(peer.get("health")) not in _LIVE:
            continue
        live.add(str(peer.get("peer_id")))
        for raw in (peer.get("record") or {}).get("devices") or []:
            devices.append(DeviceProfile.from_wire(raw))
    links = [LinkProfile.from_wire(x) for x in view.get("links", [])]
    return devices, [x for x in links if x.src in live and x.dst in live]


def default_dtype(devices: Sequence[DeviceProfile]) -> str:
    """The format of a known shape (no stored weights to read one off)."""
    return "float32" if all(d.backend == "cpu" for d in devices) else "float16"


def native_formats(spec: str, devices: Sequence[DeviceProfile]) -> dict[str, str] | None:
    """Peer id → the format a node on that device holds ``spec``'s weights in by
    default (:func:`~hetmesh.partition.checkpoint.native_weights`); None when
    ``spec`` is not a model folder with weights (a known shape, a bare config)."""
    from hetmesh.partition.checkpoint import native_for_kind, native_weights
    from hetmesh.partition.profile import KNOWN_SHAPES
    from hetmesh.partition.store import weight_files
    from hetmesh.partition.synth import is_synth_name, matrix_kind, parse_synth_name

    if is_synth_name(spec):  # the format its name spells, written or not
        kind = matrix_kind(parse_synth_name(spec))
        return {d.peer_id: native_for_kind(kind, d.backend).value for d in devices}
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    if spec in KNOWN_SHAPES or not (folder / "config.json").is_file():
        return None
    try:
        if not weight_files(folder):
            return None
    except MeshError:  # no weights there: plan it as a shape
        return None
    return {d.peer_id: native_weights(folder, d.backend).value for d in devices}


def plan_with_baselines(
    devices: Sequence[DeviceProfile],
    links: Sequence[LinkProfile],
    model: ModelProfile,
    objective: Objective,
    constraints: PlanConstraints,
) -> tuple[Plan, dict[str, Plan | str]]:
    """The planner's plan and, per baseline, its plan or why it has none."""
    chosen = plan(devices, links, model, objective=objective, constraints=constraints)
    others: dict[str, Plan | str] = {}
    for name, baseline in BASELINES.items():
        try:
            others[name] = baseline(
                devices, links, model, objective=objective, constraints=constraints
            )
        except InsufficientCapacity as exc:
            others[name] = f"does not fit ({exc.missing_bytes / 2**30:.2f} GiB short)"
    return chosen, others


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _unit_names(model: ModelProfile, start: int, end: int) -> str:
    def name(i: int) -> str:
        kind = model.units[i].kind
        return "embed" if kind == "embed" else ("head" if kind == "head" else f"L{i - 1}")

    return name(start) if end - start == 1 else f"{name(start)}…{name(end - 1)}"


def plan_renderable(
    chosen: Plan, baselines: Mapping[str, Plan | str], model: ModelProfile
) -> Group:
    """The stage map of every pipeline, then the comparison table (pure)."""
    parts: list[Table] = []
    for i, pipe in enumerate(chosen.pipelines):
        table = Table(
            title=(
                f"pipeline {i}: {_ms(pipe.decode_latency_s)}/token, "
                f"{pipe.throughput_tps:.1f} tokens/s, prefill {pipe.prefill_s_per_1k:.2f} s/1k"
            )
        )
        for col in (
            "stage",
            "peer",
            "device",
            "weights",
            "units",
            "layers",
            "step",
            "link out",
            "memory",
        ):
            table.add_column(col)
        for j, st in enumerate(pipe.stages):
            table.add_row(
                str(j),
                st.peer_id,
                st.device,
                st.weights or model.dtype,
                f"[{st.start}, {st.end})",
                _unit_names(model, st.start, st.end),
                _ms(st.decode_step_s),
                _ms(st.link_out_s),
                _gib(st.memory_bytes),
            )
        parts.append(table)
    compare = Table(title=f"{model.name}, objective {chosen.objective}: planner vs baselines")
    for col in ("strategy", "pipelines", "decode/token", "prefill/1k", "tokens/s", "planner gain"):
        compare.add_column(col)
    rows: list[tuple[str, Plan | str]] = [(f"planner ({chosen.strategy})", chosen)]
    rows += list(baselines.items())
    for name, item in rows:
        if isinstance(item, str):
            compare.add_row(name, "-", "-", "-", "-", item)
            continue
        # how many times better the planner's plan is (1.00× for the planner itself)
        if chosen.objective == "latency":
            ratio = item.decode_latency_s / chosen.decode_latency_s
        else:
            ratio = chosen.throughput_tps / item.throughput_tps
        compare.add_row(
            name,
            str(len(item.pipelines)),
            _ms(item.decode_latency_s),
            f"{item.prefill_s_per_1k:.2f} s",
            f"{item.throughput_tps:.1f}",
            f"{ratio:.2f}×",
        )
    return Group(*parts, compare)


def render_plan(
    chosen: Plan, baselines: Mapping[str, Plan | str], model: ModelProfile, *, width: int = 160
) -> str:
    """The plan as plain text (pure; used by tests)."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(plan_renderable(chosen, baselines, model))
    return console.export_text()


def _fetch_view(mesh: str, secret: str | None, timeout: float) -> dict[str, Any]:
    import trio

    from hetmesh.cli.node import first_mesh_error
    from hetmesh.discovery.host import configure_libp2p_logging
    from hetmesh.discovery.status import fetch_status

    configure_libp2p_logging()
    try:
        return trio.run(lambda: fetch_status(mesh, mesh_secret=secret, timeout_s=timeout))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mesh") from exc
    except BaseExceptionGroup as group:
        found = first_mesh_error(group)
        if found is None:
            raise
        raise found from None


@app.command("plan")
def plan_command(
    model: Annotated[
        str,
        typer.Option(help="A known shape (llama-7b, …), a synth name or a model folder."),
    ],
    devices: Annotated[Path | None, typer.Option(help=DEVICES_HELP)] = None,
    devices_schema: Annotated[
        bool,
        typer.Option(
            "--devices-schema",
            help="Print the JSON Schema of a --devices file (every field, unit, default).",
            is_eager=True,
            callback=_print_schema,
        ),
    ] = False,
    mesh: Annotated[str | None, typer.Option(help="Any node's multiaddr, with /p2p/ID.")] = None,
    objective: Annotated[str, typer.Option(help="latency or throughput.")] = "latency",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--weights",
            "--dtype",
            help="Weight format of devices that name none: native, float32, bfloat16, "
            "float16, int8 or int4 (a devices file's entries may carry their own "
            '"weights"; a live mesh\'s peers announce theirs). Default: native for a '
            "model folder (what a node holds it in), else float32 on CPUs, float16 else.",
        ),
    ] = None,
    max_context: Annotated[int, typer.Option(help="KV budget: tokens per session.")] = 2048,
    sessions: Annotated[int, typer.Option(help="KV budget: sessions per pipeline.")] = 1,
    micro_batch: Annotated[int, typer.Option(help="Tokens per micro-batch.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    mesh_secret: Annotated[str | None, typer.Option(envvar="HETMESH_MESH_SECRET")] = None,
    mesh_secret_file: Annotated[Path | None, typer.Option()] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the node.")] = 5.0,
) -> None:
    """Print the plan for a model on a mesh, with each baseline's prediction beside it."""
    if objective not in ("latency", "throughput"):
        raise typer.BadParameter("use latency or throughput", param_hint="--objective")
    if (devices is None) == (mesh is None):
        raise typer.BadParameter("give exactly one of --devices and --mesh")
    if devices is not None:
        try:
            raw = json.loads(devices.read_text())
            found, links = parse_devices(raw)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"{devices}: {exc}", param_hint="--devices") from exc
        formats = weights_in(raw)
    elif mesh is not None:
        from hetmesh.cli.node import resolve_secret

        view = _fetch_view(mesh, resolve_secret(mesh_secret, mesh_secret_file), timeout)
        formats = weights_in(view)
        try:
            found, links = devices_from_view(view)
        except ValueError as exc:
            raise MeshError(f"{mesh} sent a status view without valid profiles: {exc}") from exc
    else:  # unreachable: exactly one of the two was checked above
        raise typer.BadParameter("give exactly one of --devices and --mesh")
    if not found:
        raise InsufficientCapacity("no device to plan on", missing_bytes=0)
    from hetmesh.partition.formats import is_native, parse_weights

    native = native_formats(model, found) if dtype is None or is_native(dtype) else None
    if native is None and is_native(dtype):
        raise typer.BadParameter(
            "native is the format a model folder's weights are stored in: give a model "
            "folder with its weights, or a format",
            param_hint="--weights",
        )
    if native is not None:  # as the nodes do without --weights: the checkpoint's own
        for d in found:
            formats.setdefault(d.peer_id, native[d.peer_id])
        base = native[found[0].peer_id]
    else:
        fmt = parse_weights(dtype)
        base = fmt.value if fmt is not None else default_dtype(found)
    config, name = load_config(model)
    profile = load_model(model, base)
    for d in found:  # devices naming no format of their own serve in --weights
        formats.setdefault(d.peer_id, base)
    constraints = with_weights(
        PlanConstraints(
            max_context_tokens=max_context, max_sessions=sessions, micro_batch_tokens=micro_batch
        ),
        config,
        name,
        found,
        formats,
    )
    goal: Objective = "throughput" if objective == "throughput" else "latency"
    chosen, others = plan_with_baselines(found, links, profile, goal, constraints)
    if as_json:
        out = {
            "plan": chosen.to_wire(),
            "baselines": {
                k: (v.to_wire() if isinstance(v, Plan) else {"error": v}) for k, v in others.items()
            },
        }
        typer.echo(json.dumps(out, indent=1))
    else:
        Console().print(plan_renderable(chosen, others, profile))
