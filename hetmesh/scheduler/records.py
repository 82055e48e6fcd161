"""The scheduler's records: constraints in, plans out, load and requests for routing.

All are frozen, slotted dataclasses that travel as plain wire dicts (the
coordinator publishes a :class:`Plan` over the control plane), through
:class:`hetmesh.resources.WireRecord`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from hetmesh.resources import ModelProfile, PeerId, WireRecord

Objective = Literal["latency", "throughput"]

# Default per-unit (per-layer) dispatch overhead of one decode step, by backend:
# Python + kernel launches for one decoder layer in eager PyTorch. The node
# calibrates these per device and passes them in ``unit_overhead_s_by_device``.
DEFAULT_UNIT_OVERHEAD_S: dict[str, float] = {"cpu": 1.5e-4, "cuda": 4.0e-5, "mps": 8.0e-5}


def device_key(peer_id: PeerId, device: str) -> str:
    """The stable name of one device of one peer: ``"<peer_id>/<device>"``."""
    return f"{peer_id}/{device}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightBytes(WireRecord):
    """What one weight format costs in memory, per unit of the model.

    A device serving in ``weights`` (``"bfloat16"``, ``"int8"``…) holds
    ``param_bytes[i]`` bytes for unit ``i`` and ``kv_bytes_per_token[i]`` bytes of
    KV per cached token (the KV dtype of that format); a stage holding every unit
    loads a tied embedding/head matrix once, saving ``tied_bytes``. A stage holding
    the head also holds ``head_pack_bytes`` (a second, packed copy of an int head's
    rows, read in their stead). The node computes these from the format; the planner
    only adds bytes.
    """

    weights: str
    param_bytes: tuple[int, ...]
    kv_bytes_per_token: tuple[int, ...]
    tied_bytes: int = 0
    head_pack_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.param_bytes) != len(self.kv_bytes_per_token):
            raise ValueError("param_bytes and kv_bytes_per_token must cover the same units")
        if any(b < 0 for b in self.param_bytes) or any(b < 0 for b in self.kv_bytes_per_token):
            raise ValueError("byte counts must be non-negative")
        if not 0 <= self.tied_bytes <= sum(self.param_bytes):
            raise ValueError("tied_bytes must be between 0 and the model's bytes")
        if not 0 <= self.head_pack_bytes <= (self.param_bytes[-1] if self.param_bytes else 0):
            raise ValueError("head_pack_bytes must be between 0 and the head's bytes")

    @classmethod
    def of(cls, model: ModelProfile, weights: str | None = None) -> WeightBytes:
        """The bytes of ``model`` as profiled, named ``weights`` (default: ``model.dtype``;
        an int8 profile's dtype is its activations', so name its format here)."""
        units = model.units
        return cls(
            weights=weights or model.dtype,
            param_bytes=tuple(u.param_bytes for u in units),
            kv_bytes_per_token=tuple(u.kv_bytes_per_token for u in units),
            tied_bytes=sum(u.param_bytes for u in units) - model.total_param_bytes if units else 0,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConstraints(WireRecord):
    """What a plan must budget for, and the cost model's tunable constants.

    Memory of a stage = its weights + ``max_context_tokens × max_sessions`` tokens of
    KV for its layers + an activation workspace for a ``prefill_chunk_tokens`` chunk
    (a head stage: the logits of the sessions it samples in one step, see
    :func:`~hetmesh.scheduler.cost.head_workspace_bytes`)
    + a reserve (the larger of ``reserve_bytes`` and ``reserve_fraction`` of the
    device's total memory); it must not exceed the device's free memory.

    Step times are predicted at ``decode_context_tokens`` tokens of context (default:
    half of ``max_context_tokens``). Under the throughput objective each stage runs
    micro-batches of ``micro_batch_tokens`` tokens (one per session) and enough
    micro-batches are assumed in flight to keep every stage busy, so a pipeline's
    throughput is ``micro_batch_tokens`` ÷ its slowest stage or link.
    """

    max_context_tokens: int = 2048
    max_sessions: int = 1  # concurrent sessions each pipeline budgets KV for
    decode_context_tokens: int = 0  # 0: max_context_tokens // 2
    micro_batch_tokens: int = 1
    prefill_chunk_tokens: int = 512
    reserve_bytes: int = 256 * 1024 * 1024
    reserve_fraction: float = 0.05
    # per stage per step, outside its compute: the frame in (receive, decode, the wake-up
    # of the stage loop), the frame out (encode, send) and, for the last stage, the
    # gateway turning the token round; measured (hetmesh.node.calibration.
    # stage_overhead_from_tokens): 3.8-4.5 ms on the project's CPUs at load ~1-2
    # (docs/benchmarks.md, "Prediction error"), against 0.5 ms assumed before
    stage_overhead_s: float = 4.0e-3
    # a pipeline of one stage is fed this many tokens a step by its gateway (the stage
    # samples each token's next step itself: hetmesh.node.gateway, OpenSession.feed_steps),
    # so it pays the per-stage overhead once a feed, not once a token; 1: stepped a token
    # at a time like a pipeline of several stages
    feed_steps: int = 16
    unit_overhead_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_UNIT_OVERHEAD_S))
    unit_overhead_s_by_device: dict[str, float] = field(default_factory=dict)
    # measured seconds of one decode step of one decoder block, per device key, at
    # ``calibration_context_tokens`` of context (hetmesh.node.calibration): the cost
    # model scales that device's predicted step times so one block costs this much
    block_step_s_by_device: dict[str, float] = field(default_factory=dict)
    calibration_context_tokens: int = 128
    # the cores a CPU device's forwards may keep busy, by device key, where a quota
    # holds it under one core (the Host its node announces): its calibrated step is
    # the sustained one (CPU time ÷ share), but a stage idle for most of a token runs
    # its step at a whole core's speed (hetmesh.scheduler.cost.CostModel.pipeline)
    cpu_share_by_device: dict[str, float] = field(default_factory=dict)
    # the weight format each device serves in, by device key, as bytes per unit: its
    # memory fit, KV budget and weight reads use these (absent: the model's own profile)
    weights_by_device: dict[str, WeightBytes] = field(default_factory=dict)
    same_host_bandwidth_bps: float = 10.0e9  # two devices of one peer (shared memory)
    same_host_rtt_s: float = 2.0e-5
    default_bandwidth_bps: float = 12.5e6  # an unmeasured link: assume 100 Mbit/s
    default_rtt_s: float = 0.02
    schema_version: int = 1

    def __post_init__(self) -> None:
        if self.max_context_tokens < 1 or self.max_sessions < 1:
            raise ValueError("max_context_tokens and max_sessions must be positive")
        if self.micro_batch_tokens < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("micro_batch_tokens and prefill_chunk_tokens must be positive")
        if self.feed_steps < 1:
            raise ValueError("feed_steps must be positive")
        if self.decode_context_tokens < 0 or self.reserve_bytes < 0:
            raise ValueError("decode_context_tokens and reserve_bytes must be non-negative")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError("reserve_fraction must be in [0, 1)")
        if self.default_bandwidth_bps <= 0 or self.same_host_bandwidth_bps <= 0:
            raise ValueError("link bandwidths must be positive")
        if self.calibration_context_tokens < 1:
            raise ValueError("calibration_context_tokens must be positive")
        if any(not v > 0 for v in self.block_step_s_by_device.values()):
            raise ValueError("measured block step times must be positive")
        if any(not 0 < v <= 1 for v in self.cpu_share_by_device.values()):
            raise ValueError("a device's CPU share lies in (0, 1]")

    @property
    def context_tokens(self) -> int:
        """The context length step times are predicted at."""
        return self.decode_context_tokens or max(1, self.max_context_tokens // 2)

    def unit_overhead_for(self, peer_id: PeerId, device: str, backend: str) -> float:
        key = device_key(peer_id, device)
        if key in self.unit_overhead_s_by_device:
            return self.unit_overhead_s_by_device[key]
        return self.unit_overhead_s.get(backend, DEFAULT_UNIT_OVERHEAD_S.get(backend, 0.0))

    def block_step_for(self, peer_id: PeerId, device: str) -> float | None:
        """The measured decode step of one block on this device, if calibrated."""
        return self.block_step_s_by_device.get(device_key(peer_id, device))

    def cpu_share_for(self, peer_id: PeerId, device: str) -> float:
        """The share of one core this device's quota allows (1.0: a core or more)."""
        return self.cpu_share_by_device.get(device_key(peer_id, device), 1.0)

    def weights_for(self, peer_id: PeerId, device: str) -> WeightBytes | None:
        """The bytes per unit of the format this device serves in, if announced."""
        return self.weights_by_device.get(device_key(peer_id, device))


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage(WireRecord):
    """Units ``[start, end)`` of the model on one device, with predicted costs."""

    peer_id: PeerId
    device: str
    start: int
    end: int
    decode_step_s: float  # one decode step of one token (latency view)
    batch_step_s: float  # one step of a micro-batch (throughput view)
    prefill_s_per_1k: float  # a 1,000-token prompt through this stage
    link_out_s: float  # sending one token's boundary activation to the next stage
    memory_bytes: int  # weights + KV budget + workspace + reserve
    weights: str = ""  # the weight format the device holds these units in

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"bad unit range [{self.start}, {self.end})")

    @property
    def key(self) -> str:
        return device_key(self.peer_id, self.device)


@dataclass(frozen=True, slots=True, kw_only=True)
class Pipeline(WireRecord):
    """An ordered chain of stages covering every unit once: one data-parallel replica."""

    stages: tuple[Stage, ...]
    decode_latency_s: float  # per output token for one stream, links and return included
    prefill_s_per_1k: float
    bottleneck_s: float  # slowest stage or link occupancy per micro-batch
    throughput_tps: float  # tokens/s with micro-batches in flight

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            if before.end != after.start:
                raise ValueError("stages must be contiguous")
        if self.stages[0].start != 0:
            raise ValueError("the first stage must start at unit 0")

    @property
    def key(self) -> str:
        """Names the assignment; equal assignments in different epochs share it."""
        return "|".join(f"{s.key}:{s.start}-{s.end}" for s in self.stages)

    @property
    def peers(self) -> frozenset[PeerId]:
        return frozenset(s.peer_id for s in self.stages)

    @property
    def num_units(self) -> int:
        return self.stages[-1].end


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(WireRecord):
    """One or more pipelines for a model, with what the cost model predicts for them."""

    epoch: int
    model_name: str
    objective: Objective
    strategy: str  # "exact", "heuristic", "even", "memory-proportional", "greedy"
    pipelines: tuple[Pipeline, ...]
    objective_value: float  # latency: seconds per token (lower is better); throughput: tokens/s
    decode_latency_s: float  # of the fastest pipeline
    prefill_s_per_1k: float  # of the fastest pipeline
    throughput_tps: float  # all pipelines together
    constraints: PlanConstraints = field(default_factory=PlanConstraints)
    # the coordinator's term it was signed in: a new coordinator numbers its term above
    # every term followed, and a node never follows a plan of a term before its plan's
    # (scheduler.plan_trust: an old plan of a former coordinator is not adopted again)
    term: int = 0
    schema_version: int = 1

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError("epoch must be non-negative")
        if self.term < 0:
            raise ValueError("term must be non-negative")
        if not self.pipelines:
            raise ValueError("a plan needs at least one pipeline")

    def with_epoch(self, epoch: int) -> Plan:
        return Plan(
            epoch=epoch,
            model_name=self.model_name,
            objective=self.objective,
            strategy=self.strategy,
            pipelines=self.pipelines,
            objective_value=self.objective_value,
            decode_latency_s=self.decode_latency_s,
            prefill_s_per_1k=self.prefill_s_per_1k,
            throughput_tps=self.throughput_tps,
            constraints=self.constraints,
            term=self.term,
        )

    def with_term(self, term: int) -> Plan:
        return dataclasses.replace(self, term=term)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineLoad(WireRecord):
    """What a gateway knows of one pipeline's current work."""

    active_sessions: int = 0
    queued_requests: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshLoad(WireRecord):
    """The router's live inputs: load per pipeline key, health, session affinity."""

    pipelines: dict[str, PipelineLoad] = field(default_factory=dict)
    unhealthy_peers: tuple[PeerId, ...] = ()
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> pipeline key


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRequest(WireRecord):
    """A request to place: its session (for affinity) and its size."""

    session_id: str = ""
    prompt_tokens: int = 0
    max_new_tokens: int = 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.max_new_tokens < 0:
            raise ValueError("token counts must be non-negative")


__all__ = [
    "DEFAULT_UNIT_OVERHEAD_S",
    "MeshLoad",
    "Objective",
    "Pipeline",
    "PipelineLoad",
    "Plan",
    "PlanConstraints",
    "RouteRequest",
    "Stage",
    "WeightBytes",
    "device_key",
]
