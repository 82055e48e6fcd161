"""What a serving node announces about its share of the work: one typed record.

A node's discovery record (:class:`hetmesh.discovery.wire.Announcement`)
carries its serving state in its ``extra`` map and its ``stages`` list. This
module is the only place that writes (:func:`serving_extra`,
:func:`serving_stages`) and reads (:func:`read_serving`) them; the plan
loop, the status CLI, the dashboard's event feed and the planner's
calibration and weight inputs all go through :func:`read_serving`.

```
extra["serving_version"]  1 (absent: 1; another number: the whole state is ignored)
extra["model"]            the model key served ("" or absent: not serving)
extra["weights"]          the weight format its stages are held in
extra["calibration"]      Calibration: one block's measured decode step
extra["host"]             Host: the cores its stages compute on (a CPU node's; absent: none)
extra["plan"]             the Plan it follows
extra["plan_signature"]   PlanSignature: the coordinator's signature of that plan
extra["insufficient"]     why the coordinator cannot place the model ("" when it can)
extra["gateway"]          the gateway's counters (name -> number)
extra["stage_servers"]    one map of counters per stage server
extra["manifest"]         the manifest id (sha256 hex) of the model's weights held
extra["units_held"]       [[start, end), ...]: the units whose tensors it holds on disk
extra["shards"]           its tensor transfer counters (bytes fetched/served, fetch progress)
extra["prefix_summaries"] [[start, end, summary], ...]: per stage, the prefix-cache blocks it
                          holds (scheduler.prefix_summary: a bounded hint for routing)
stages                    ServedStage per unit range held, ready or retiring
```

Reading is bounds-checked and lenient per entry: an entry that is missing,
ill-typed or out of bounds reads as its empty value (the rest of the record
still counts), since what other nodes announce may be anything. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, TypeVar

from hetmesh.resources import WireRecord
from hetmesh.scheduler.plan_trust import Offer, PlanSignature
from hetmesh.scheduler.prefix_summary import SUMMARY_BLOCKS, decode_summary
from hetmesh.scheduler.records import Plan, PlanConstraints, device_key

SERVING_VERSION = 1
MAX_NAME_CHARS = 256  # model keys, weight formats, device names
MAX_VERDICT_CHARS = 4096
MAX_STAGES = 256
MAX_COUNTERS = 64
MAX_UNITS = 1 << 20  # unit indices: far above any model's layer count
# A block's decode step no real device beats (a tiny block on a fast GPU takes
# ~1e-5 s): a figure below it is a claim, not a measurement, and is refused, so a
# member cannot attract the whole model by announcing an absurdly fast step.
MIN_BLOCK_STEP_S = 1e-6
MAX_BLOCK_STEP_S = 3600.0
MAX_CHUNK_COST = 100.0  # a prefill's chunks against it whole (0: not measured)
MAX_HOST_CORES = 1 << 16  # cores of one machine
MAX_HOST_KEY_CHARS = 64
MAX_CONTEXT_TOKENS = 1 << 24
MAX_SUMMARY_CHARS = 8 * SUMMARY_BLOCKS  # one stage's prefix summary (hex)
MAX_HELD_RANGES = 64  # runs of units held on disk (a node holds a few runs at most)

R = TypeVar("R", bound=WireRecord)
PlanParser = Callable[[Mapping[str, object]], Plan | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedStage(WireRecord):
    """A unit range ``[start, end)`` of ``model`` this node holds."""

    model: str
    start: int
    end: int
    ready: bool  # False while it is retiring (it finishes its sessions, takes no new ones)

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= MAX_UNITS or len(self.model) > MAX_NAME_CHARS:
            raise ValueError(f"bad served stage {self.model!r} [{self.start}, {self.end})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration(WireRecord):
    """One decoder block's measured decode step on ``device``, for ``model`` in ``weights``."""

    model: str
    device: str
    block_step_s: float
    context_tokens: int  # the context the step was timed at
    weights: str = ""
    # a prefill's chunks ÷ the prefill whole, timed on the same block (0: not measured;
    # hetmesh.partition.prefill.route_chunk_tokens reads it)
    prefill_chunk_cost: float = 0.0
    # what each further session of a decode round adds, as a fraction of a one-session
    # step, timed on the same block (1: not measured, or as dear as a step of its own;
    # the router reads it, hetmesh.scheduler.router)
    row_cost: float = 1.0

    def __post_init__(self) -> None:
        if not MIN_BLOCK_STEP_S <= self.block_step_s <= MAX_BLOCK_STEP_S:  # NaN fails too
            raise ValueError(
                f"block_step_s must lie in [{MIN_BLOCK_STEP_S}, {MAX_BLOCK_STEP_S}],"
                f" not {self.block_step_s}"
            )
        if not 0 <= self.context_tokens <= MAX_CONTEXT_TOKENS:
            raise ValueError(f"context_tokens must lie in [0, {MAX_CONTEXT_TOKENS}]")
        if not 0 <= self.prefill_chunk_cost <= MAX_CHUNK_COST:  # NaN fails too
            raise ValueError(f"prefill_chunk_cost must lie in [0, {MAX_CHUNK_COST}]")
        if not 0 <= self.row_cost <= 1:  # NaN fails too
            raise ValueError("row_cost must lie in [0, 1]")
        if max(len(self.model), len(self.device), len(self.weights)) > MAX_NAME_CHARS:
            raise ValueError("calibration names are too long")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host(WireRecord):
    """The CPU cores a node's stages compute on: nodes announcing the same ``key`` run on
    the same ``cores`` cores of one machine; this node's forwards keep ``share`` busy."""

    key: str
    cores: float
    share: float

    def __post_init__(self) -> None:
        if not self.key or len(self.key) > MAX_HOST_KEY_CHARS:
            raise ValueError(f"a host key has 1 to {MAX_HOST_KEY_CHARS} characters")
        if not 0 < self.cores <= MAX_HOST_CORES:  # NaN fails too
            raise ValueError(f"cores must lie in (0, {MAX_HOST_CORES}]")
        if not 0 < self.share <= self.cores:
            raise ValueError("share must lie in (0, cores]")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingAnnouncement:
    """A node's serving state, as announced (see the module docstring for the layout)."""

    model: str = ""
    weights: str = ""
    calibration: Calibration | None = None
    host: Host | None = None
    plan: Plan | None = None
    plan_signature: PlanSignature | None = None  # who signed ``plan`` (plan_trust)
    insufficient: str = ""
    stages: tuple[ServedStage, ...] = ()
    gateway: Mapping[str, float] = field(default_factory=dict)
    stage_servers: tuple[Mapping[str, object], ...] = ()
    manifest: str = ""
    units_held: tuple[tuple[int, int], ...] = ()
    shards: Mapping[str, float] = field(default_factory=dict)
    # (start, end) of a stage -> its summary (prefix_summary.encode_summary) as announced
    prefix_summaries: Mapping[tuple[int, int], str] = field(default_factory=dict)

    def prefix_summary(self, start: int, end: int) -> frozenset[int]:
        """The truncated block hashes stage ``[start, end)`` announces it holds."""
        return decode_summary(self.prefix_summaries.get((start, end)))


def parse_plan(raw: Mapping[str, object]) -> Plan | None:
    """A plan from its wire map; None if it is malformed."""
    try:
        return Plan.from_wire(dict(raw))
    except (ValueError, TypeError):
        return None


def read_serving(
    extra: object,
    stages: object = (),
    *,
    plan_of: PlanParser | None = parse_plan,
) -> ServingAnnouncement:
    """The serving state in a record's ``extra`` and ``stages`` (the one reader).

    ``plan_of`` parses the announced plan (a caching parser for readers that
    meet the same plan often); ``None`` skips it (``plan`` stays None), for
    readers that need the cheap fields only.
    """
    extra = extra if isinstance(extra, Mapping) else {}
    version = extra.get("serving_version", SERVING_VERSION)
    if version != SERVING_VERSION or isinstance(version, bool):
        return ServingAnnouncement()
    raw_plan = extra.get("plan")
    return ServingAnnouncement(
        model=_name(extra.get("model")),
        weights=_name(extra.get("weights")),
        calibration=_record(Calibration, extra.get("calibration")),
        host=_record(Host, extra.get("host")),
        plan=plan_of(raw_plan) if plan_of is not None and isinstance(raw_plan, Mapping) else None,
        plan_signature=_record(PlanSignature, extra.get("plan_signature")),
        insufficient=_text(extra.get("insufficient"), MAX_VERDICT_CHARS),
        stages=tuple(
            s
            for s in (_record(ServedStage, x) for x in _items(stages, MAX_STAGES))
            if s is not None
        ),
        gateway=_counters(extra.get("gateway")),
        stage_servers=tuple(
            dict(x) for x in _items(extra.get("stage_servers"), MAX_STAGES) if _is_map(x)
        ),
        manifest=_manifest_id(extra.get("manifest")),
        units_held=_held(extra.get("units_held")),
        shards=_counters(extra.get("shards")),
        prefix_summaries=_summaries(extra.get("prefix_summaries")),
    )


def read_offer(extra: object, relayed_by: str) -> Offer | None:
    """The plan an announcement's ``extra`` carries, with its signature, as relayed by
    ``relayed_by`` (None: no well-formed plan); judged by ``plan_trust.plan_refusal``."""
    served = read_serving(extra)
    if served.plan is None:
        return None
    return Offer(served.plan, served.plan_signature, relayed_by)


def serving_extra(state: ServingAnnouncement) -> dict[str, object]:
    """The ``extra`` entries announcing ``state`` (every key, empty ones included, so that
    a cleared entry replaces the old value)."""
    return {
        "serving_version": SERVING_VERSION,
        "model": state.model,
        "weights": state.weights,
        "calibration": state.calibration.to_wire() if state.calibration is not None else None,
        "host": state.host.to_wire() if state.host is not None else None,
        "plan": state.plan.to_wire() if state.plan is not None else None,
        "plan_signature": (
            state.plan_signature.to_wire() if state.plan_signature is not None else None
        ),
        "insufficient": state.insufficient,
        "gateway": dict(state.gateway),
        "stage_servers": [dict(s) for s in state.stage_servers],
        "manifest": state.manifest,
        "units_held": [list(r) for r in state.units_held],
        "shards": dict(state.shards),
        "prefix_summaries": [[a, b, text] for (a, b), text in state.prefix_summaries.items()],
    }


def serving_stages(state: ServingAnnouncement) -> list[dict[str, object]]:
    """The record's ``stages`` list announcing ``state``."""
    return [s.to_wire() for s in state.stages]


def _name(value: object) -> str:
    return _text(value, MAX_NAME_CHARS)


def _text(value: object, limit: int) -> str:
    return value if isinstance(value, str) and len(value) <= limit else ""


def _manifest_id(value: object) -> str:
    text = _text(value, 64)
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else ""


def _held(value: object) -> tuple[tuple[int, int], ...]:
    """Unit runs held; an ill-formed run is dropped (the others still count)."""
    if not isinstance(value, list | tuple) or len(value) > MAX_HELD_RANGES:
        return ()
    out = []
    for run in value:
        if (
            isinstance(run, list | tuple)
            and len(run) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in run)
            and 0 <= run[0] < run[1] <= MAX_UNITS
        ):
            out.append((int(run[0]), int(run[1])))
    return tuple(out)


def _summaries(value: object) -> dict[tuple[int, int], str]:
    """Per-stage summaries; an ill-formed entry is dropped. Decoded (and bounds-checked)
    when a router asks for one: most readers never do."""
    out: dict[tuple[int, int], str] = {}
    for entry in _items(value, MAX_STAGES):
        if (
            isinstance(entry, list | tuple)
            and len(entry) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[:2])
            and 0 <= entry[0] < entry[1] <= MAX_UNITS
            and isinstance(entry[2], str)
            and len(entry[2]) <= MAX_SUMMARY_CHARS
        ):
            out[(int(entry[0]), int(entry[1]))] = entry[2]
    return out


def _is_map(value: object) -> TypeGuard[Mapping[str, object]]:
    return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)


def _items(value: object, limit: int) -> Sequence[object]:
    return value[:limit] if isinstance(value, list | tuple) else ()


def _record(kind: type[R], value: object) -> R | None:
    if not isinstance(value, dict):
        return None
    try:
        return kind.from_wire(value)
    except (ValueError, TypeError):
        return None


def _counters(value: object) -> dict[str, float]:
    if not _is_map(value) or len(value) > MAX_COUNTERS:
        return {}
    return {
        k: v
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def quota_constraints(
    constraints: PlanConstraints, announced: Sequence[tuple[str, Mapping[str, object]]]
) -> PlanConstraints:
    """``constraints`` with each CPU node's quota filled in: a peer whose announced
    :class:`Host` share is under one core gets ``cpu_share_by_device`` for its ``cpu``
    device (the cost model then predicts its stages of a cut at a whole core's
    speed while the rest of the token leaves it idle; see
    :class:`~hetmesh.scheduler.cost.CostModel`). ``announced``: (peer id, that peer's
    announcement ``extra``); a peer with no host, or one of a core or more, is left out.
    """
    shares: dict[str, float] = {}
    for peer_id, extra in announced:
        host = read_serving(extra, plan_of=None).host
        if host is not None and host.share < 1.0:
            shares[device_key(peer_id, "cpu")] = host.share
    if shares == constraints.cpu_share_by_device:
        return constraints
    return dataclasses.replace(constraints, cpu_share_by_device=shares)


__all__ = [
    "SERVING_VERSION",
    "Calibration",
    "Host",
    "ServedStage",
    "ServingAnnouncement",
    "parse_plan",
    "quota_constraints",
    "read_offer",
    "read_serving",
    "serving_extra",
    "serving_stages",
]
