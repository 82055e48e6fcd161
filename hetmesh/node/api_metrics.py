"""The HTTP API's Prometheus metrics: request histograms plus the node's gauges.

TTFT and TPOT are observed per API request; queue depth, sessions, KV bytes,
recoveries, rejections and per-link bandwidth are read from the node's
statistics at scrape time (:class:`MeshGauges`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshGauges:
    """The node-side figures /metrics exports (read at scrape time)."""

    ready: bool = False
    plan_epoch: int = -1
    queue_depth: int = 0
    active_sessions: int = 0
    gateway_sessions: int = 0
    kv_bytes_used: int = 0
    kv_bytes_free: int = 0
    recoveries: int = 0
    rejected_busy: int = 0
    tokens_out: int = 0
    sessions_failed: int = 0
    prefix_tokens_skipped: int = 0  # prompt tokens this gateway's sessions found cached
    # speculative decoding (issue 48): this gateway's verify steps, the drafts they
    # carried, the drafts kept, the tokens they brought
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0
    links: tuple[tuple[str, str, float, float], ...] = ()  # src, dst, rtt_s, bandwidth_bps
    shard_bytes_fetched: int = 0
    shard_bytes_served: int = 0
    shard_verification_failures: int = 0
    # per stage served here: its units ("start-end") and kv_* counters (node.kvcache.kv_counters)
    stages_kv: tuple[tuple[str, Mapping[str, float]], ...] = ()
    # hetmesh.node.memory: really in use, what the plan charged, the uncharged runtime
    memory_in_use_bytes: int = 0
    memory_charged_bytes: int = 0
    memory_runtime_bytes: int = 0


class GaugeSource(Protocol):
    def gauges(self) -> MeshGauges: ...


class _MeshCollector:
    def __init__(self, backend: GaugeSource) -> None:
        self.backend = backend

    def collect(self) -> list[Metric]:
        g = self.backend.gauges()
        out: list[Metric] = []

        def gauge(name: str, doc: str, value: float) -> None:
            out.append(GaugeMetricFamily(name, doc, value=value))

        def counter(name: str, doc: str, value: float) -> None:
            out.append(CounterMetricFamily(name, doc, value=value))

        gauge("hetmesh_ready", "1 when a pipeline of the plan is fully ready", float(g.ready))
        gauge("hetmesh_plan_epoch", "Epoch of the adopted plan (-1: none)", g.plan_epoch)
        gauge("hetmesh_queue_depth", "Steps waiting at this node's stages", g.queue_depth)
        gauge("hetmesh_active_sessions", "Sessions holding KV at this node", g.active_sessions)
        gauge("hetmesh_gateway_sessions", "Sessions this node drives", g.gateway_sessions)
        gauge("hetmesh_kv_bytes_used", "KV cache bytes in use at this node", g.kv_bytes_used)
        gauge("hetmesh_kv_bytes_free", "KV cache bytes still free", g.kv_bytes_free)
        counter("hetmesh_recoveries", "Sessions re-routed after a stage failed", g.recoveries)
        counter("hetmesh_gateway_rejected_busy", "Admissions refused busy", g.rejected_busy)
        counter("hetmesh_tokens_out", "Tokens streamed by this gateway", g.tokens_out)
        counter("hetmesh_sessions_failed", "Sessions that ended in an error", g.sessions_failed)
        counter(
            "hetmesh_gateway_prefix_tokens_skipped",
            "Prompt tokens of this gateway's sessions found in every stage's prefix cache",
            g.prefix_tokens_skipped,
        )
        counter("hetmesh_speculative_steps", "Decode steps sent with drafts", g.verify_steps)
        counter("hetmesh_speculative_drafted", "Draft tokens sent", g.drafted)
        counter("hetmesh_speculative_accepted", "Draft tokens the last stage kept", g.accepted)
        counter(
            "hetmesh_speculative_tokens",
            "Tokens the steps with drafts brought (kept drafts and the target's own)",
            g.verified_tokens,
        )
        counter(
            "hetmesh_shard_bytes_fetched", "Tensor bytes fetched from peers", g.shard_bytes_fetched
        )
        counter("hetmesh_shard_bytes_served", "Tensor bytes sent to peers", g.shard_bytes_served)
        counter(
            "hetmesh_shard_verification_failures",
            "Tensors from peers whose bytes did not match the manifest",
            g.shard_verification_failures,
        )
        gauge("hetmesh_memory_in_use_bytes", "Memory really in use", g.memory_in_use_bytes)
        gauge("hetmesh_memory_charged_bytes", "Memory the plan charged", g.memory_charged_bytes)
        gauge("hetmesh_memory_runtime_bytes", "In use before any stage", g.memory_runtime_bytes)
        bandwidth = GaugeMetricFamily(
            "hetmesh_link_bandwidth_bytes_per_second",
            "Measured bandwidth of a link",
            labels=["src", "dst"],
        )
        rtt = GaugeMetricFamily("hetmesh_link_rtt_seconds", "Measured RTT", labels=["src", "dst"])
        for src, dst, rtt_s, bps in g.links:
            bandwidth.add_metric([src, dst], bps)
            rtt.add_metric([src, dst], rtt_s)
        out += [bandwidth, rtt]
        out += _stage_kv_metrics(g.stages_kv)
        return out


# kv_* counter -> (metric, help, kind); blocks are one gauge labelled by state
_KV_METRICS = {
    "kv_prefix_hit_rate": ("hetmesh_prefix_cache_hit_rate", "Prompt tokens found cached", "g"),
    "kv_prefix_hit_tokens": ("hetmesh_prefix_cache_hit_tokens", "Prompt tokens not prefilled", "c"),
    "kv_preempted": ("hetmesh_kv_preemptions", "Sessions preempted for KV room", "c"),
    "kv_migrations": ("hetmesh_kv_migrations", "Sessions whose KV moved here", "c"),
    "kv_migrated_bytes": ("hetmesh_kv_migrated_bytes", "Bytes of KV moved here", "c"),
    "kv_migrations_out": ("hetmesh_kv_migrations_out", "Sessions whose KV moved away", "c"),
    "kv_waiting": ("hetmesh_kv_waiting", "Refused sessions keeping their place in line", "g"),
}


def _stage_kv_metrics(stages: Sequence[tuple[str, Mapping[str, float]]]) -> list[Metric]:
    blocks = GaugeMetricFamily(
        "hetmesh_kv_blocks",
        "KV blocks of a stage's pool: in use, free (cached ones included) or cached",
        labels=["stage", "state"],
    )
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for key, (name, doc, kind) in _KV_METRICS.items():
        cls = GaugeMetricFamily if kind == "g" else CounterMetricFamily
        families[key] = cls(name, doc, labels=["stage"])
    for stage, counters in stages:
        for state in ("in_use", "free", "cached"):
            blocks.add_metric([stage, state], float(counters.get(f"kv_blocks_{state}", 0)))
        for key, family in families.items():
            family.add_metric([stage], float(counters.get(key, 0)))
    return [blocks, *families.values()]


@dataclass(slots=True)
class ApiMetrics:
    """The API's Prometheus registry: request histograms plus the node's gauges."""

    backend: GaugeSource
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    tpot: Histogram = field(init=False)
    requests: Counter = field(init=False)
    rejected: Counter = field(init=False)
    inflight: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            "hetmesh_ttft_seconds",
            "Time to first token of API requests",
            buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.tpot = Histogram(
            "hetmesh_tpot_seconds",
            "Mean time per output token after the first, per API request",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=r,
        )
        self.requests = Counter(
            "hetmesh_api_requests",
            "API requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "hetmesh_rejected_requests", "API requests refused, by reason", ["reason"], registry=r
        )
        self.inflight = Gauge("hetmesh_api_inflight_requests", "Requests in progress", registry=r)
        r.register(_MeshCollector(self.backend))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ApiMetrics", "GaugeSource", "MeshGauges"]
