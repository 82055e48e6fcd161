"""What every pipeline-named benchmark shares: the memory caps that make the planner
cut the model into K stages, and the check that the plan it adopted is the one its
figures assume.

Every node of a loopback mesh could hold a small model whole (the default model
as int4 is ~60 MB), and the planner then rightly places whole-model replicas: no
activation crosses a stage hop. :func:`node_args_for` gives each node a
``--max-memory`` computed from the model's bytes in the nodes' format
(:func:`hetmesh.scheduler.caps.node_memory_cap`) so that K nodes hold the model
and K - 1 do not; :func:`require_plan` fails the run when the settled plan has
another shape, and :func:`describe` prints it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

PLANNED_SESSIONS = 8  # hetmesh.node.config.PLANNED_SESSIONS: a node's default


class PlanShapeError(RuntimeError):
    """The adopted plan is not the layout the benchmark's figures assume."""


def concrete_weights(model_dir: Path, weights: str, device: str = "cpu") -> str:
    """The format a node started with ``--weights weights`` serves in (``native``: the
    checkpoint's own, int4 for the default model)."""
    from hetmesh.partition.checkpoint import settle_weights

    fmt = settle_weights(weights, model_dir, device)
    if fmt is None:
        raise ValueError("--weights auto is settled by calibration: name a format to cut")
    return fmt.value


def memory_cap(
    model_dir: Path,
    weights: str,
    stages: int,
    *,
    max_context: int = 2048,
    max_sessions: int = PLANNED_SESSIONS,
    reserve_bytes: int | None = None,
) -> int:
    """``--max-memory`` (bytes) for nodes serving ``model_dir`` in ``weights`` so that the
    model needs exactly ``stages`` of them (1: each holds it whole)."""
    from hetmesh.node.config import ServingConfig
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir
    from hetmesh.scheduler.caps import node_memory_cap

    config = check_model_dir(model_dir)
    name = model_dir.name
    return node_memory_cap(
        model_profile(config, name=name),
        weight_bytes(config, concrete_weights(model_dir, weights), name=name),
        stages,
        max_context_tokens=max_context,
        max_sessions=max_sessions,
        reserve_bytes=ServingConfig().reserve_bytes if reserve_bytes is None else reserve_bytes,
    )


def option(args: Sequence[str], name: str, default: str) -> str:
    """The value of ``name`` in a node's argument list (``default`` if absent)."""
    args = list(args)
    return args[args.index(name) + 1] if name in args else default


def node_args_for(model_dir: Path, stages: int, args: Sequence[str]) -> list[str]:
    """``args`` (a node's, with ``--weights``, ``--max-context``, ``--max-sessions``)
    with a ``--max-memory`` that makes ``model_dir`` need ``stages`` nodes."""
    out = list(args)
    if "--max-memory" in out:  # replaced: the cap is the point
        at = out.index("--max-memory")
        del out[at : at + 2]
    cap = memory_cap(
        model_dir,
        option(out, "--weights", "native"),
        stages,
        max_context=int(option(out, "--max-context", "2048")),
        max_sessions=int(option(out, "--max-sessions", str(PLANNED_SESSIONS))),
    )
    return [*out, "--max-memory", str(cap)]


def describe(plan: Any, names: dict[str, str] | None = None) -> list[list[tuple[str, int, int]]]:
    """Each pipeline's stages as (node, start, end)."""
    names = names or {}
    return [
        [(names.get(s.peer_id, s.peer_id[-6:]), s.start, s.end) for s in p.stages]
        for p in plan.pipelines
    ]


def require_plan(
    plan: Any,
    what: str,
    ok: Callable[[Any], bool],
    names: dict[str, str] | None = None,
) -> None:
    """Raise :class:`PlanShapeError` (the run fails) unless ``ok(plan)``."""
    if plan is None or not ok(plan):
        shape = describe(plan, names) if plan is not None else "no plan"
        raise PlanShapeError(f"the adopted plan is not {what}: {shape}")


def stages_of(plan: Any) -> list[int]:
    """The number of stages of each pipeline."""
    return [len(p.stages) for p in plan.pipelines]


def every_pipeline_has(stages: int) -> Callable[[Any], bool]:
    return lambda plan: bool(plan.pipelines) and set(stages_of(plan)) == {stages}


def node_names(peer_ids: Iterable[str]) -> dict[str, str]:
    return {peer: f"node{i}" for i, peer in enumerate(peer_ids)}
