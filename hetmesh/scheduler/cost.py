"""The cost model: how long a unit range takes on a device, what it holds, what links cost.

For units ``[a, b)`` on device ``d``, a step over ``t`` tokens at context ``c``:

- compute term: ``t · Σ(flops_per_token + c · attention_flops_per_token_per_context)``
  ÷ the device's measured matmul FLOP/s;
- memory term: (weights read once per step + ``t · c`` tokens of KV read) ÷ the
  device's measured memory bandwidth (the embedding reads only its looked-up rows,
  counted as zero);
- step time = max(compute, memory) — the two overlap on real hardware, and decode
  is usually memory-bound — plus ``(b - a) ×`` the device's per-unit dispatch
  overhead (Python and kernel launches; dominant on CPU for small models) plus a
  fixed per-stage overhead.
- calibration: where the device measured a real decoder block's decode step
  (``PlanConstraints.block_step_s_by_device``), its decode step times are that
  roofline (overheads included) scaled by measured ÷ modelled for one block at
  the calibration context, so one block costs what was measured and other
  ranges keep the roofline's proportions (the head and the KV term included).
  Prefill (compute-bound) stays on the roofline.

CPU quotas: a device whose quota allows a share ``q`` < 1 of a core
(``PlanConstraints.cpu_share_by_device``) is calibrated on its sustained step
(CPU time ÷ ``q``), which is what a stage busy all the time gets. A stage of a
cut serving one stream is idle while the others compute: the quota's period
lets it run its step at a whole core's speed as long as it uses under ``q`` of
the token. So a pipeline's decode latency is ``max(Σ bursts + links, the
slowest sustained step)``: each stage's step at ``q ×`` its compute (plus its
overhead) in sequence, unless one stage's quota makes it the bound (a stage
alone on its device: its sustained step, as before). The search keeps summing
sustained steps (an upper bound); the pipelines it finds are predicted, ordered
(which one is primary) and routed on by the rule.

Links: a pair's measured link, its RTT the lower of the two directions' (one
probe queued behind traffic reads it long), its bandwidth this direction's where
measured; two devices of one peer or an unmeasured pair get the constraints'
defaults. A boundary activation costs ``bytes ÷ bandwidth + RTT / 2`` on the latency path and
``bytes ÷ bandwidth`` of link occupancy on the throughput path (RTT overlaps when
micro-batches are in flight). A pipeline's per-token decode latency is the sum of
its stage steps and links, plus the sampled token's return from the last stage to
the first. Its throughput is ``t`` ÷ the slowest stage step or link occupancy.

Stage memory = weights (tied embeddings counted once when one stage holds both
ends) + KV budget + activation workspace + reserve; see
:class:`~hetmesh.scheduler.records.PlanConstraints`.

Weight formats: each device may serve in its own format (bf16 on one, int8 on
another). Its weight bytes, KV bytes per token (memory fit, KV budget, the
memory term) come from ``PlanConstraints.weights_by_device`` (bytes per unit,
computed by the node from the format), else from the model profile; its
calibration was timed in that format. FLOPs do not depend on the format.

Pure: numpy for the all-ranges matrices the search uses, nothing else.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler.records import (
    Objective,
    Pipeline,
    PlanConstraints,
    Stage,
    WeightBytes,
    device_key,
)

FloatArray = npt.NDArray[np.float64]
INF = math.inf
PREFILL_TOKENS = 1000
_WORKSPACE_FACTOR = 8  # MLP intermediates and attention scratch, in hidden-size rows
_LOGIT_BYTES = 4  # float32 logits (every format's head returns them in float32)


def head_workspace_bytes(vocab_size: int, constraints: PlanConstraints) -> int:
    """The logits a head stage holds at once: one float32 row of the vocabulary per
    session sampled in one forward (a node's head computes the last position of each
    chunk only, never a row per prompt token), for as many sessions as a step batches.

    So it scales with the model's vocabulary, not a fixed budget: 8 sessions of a
    49,152-token vocabulary hold 1.5 MiB, of a 128,256-token one 3.9 MiB.
    """
    rows = max(constraints.max_sessions, constraints.micro_batch_tokens)
    return rows * vocab_size * _LOGIT_BYTES


@dataclass(frozen=True, slots=True)
class _FormatCost:
    """Byte matrices ``M[a, b]`` over unit ranges for one weight format."""

    weights: str
    resident: FloatArray  # weights + KV budget + workspace, no reserve
    read: FloatArray  # weight bytes one decode step reads
    kv: FloatArray  # KV bytes per cached token
    prefill_bytes: FloatArray  # bytes a 1,000-token prefill reads
    block_bytes: float  # one decoder block's weights (what calibration timed)
    block_kv_bytes: float


@dataclass(frozen=True, slots=True)
class Assignment:
    """A device (index into the cost model's sorted devices) holding ``[start, end)``."""

    device: int
    start: int
    end: int


def sort_devices(devices: Sequence[DeviceProfile]) -> list[DeviceProfile]:
    """Devices in canonical order; duplicates are refused."""
    ordered = sorted(devices, key=lambda d: (d.peer_id, d.device))
    for before, after in itertools.pairwise(ordered):
        if (before.peer_id, before.device) == (after.peer_id, after.device):
            raise ValueError(f"device {device_key(after.peer_id, after.device)} listed twice")
    return ordered


class CostModel:
    """Costs of every unit range on every device of one mesh, for one model."""

    def __init__(
        self,
        model: ModelProfile,
        devices: Sequence[DeviceProfile],
        links: Sequence[LinkProfile],
        constraints: PlanConstraints,
    ) -> None:
        if model.num_units < 1:
            raise ValueError("the model has no units")
        self.model = model
        self.constraints = constraints
        self.devices = sort_devices(devices)
        self.n = model.num_units
        # the per-stage overhead of a step over [a, b): once a feed for the whole model
        # (see stage_overhead_s)
        self._stage_overhead = np.full((self.n + 1, self.n + 1), constraints.stage_overhead_s)
        self._stage_overhead[0, self.n] = self.stage_overhead_s(0, self.n)
        self.context = min(
            constraints.context_tokens, model.max_context or constraints.context_tokens
        )
        units = model.units
        self.hidden_bytes = float(units[0].output_bytes_per_token)
        self.token_bytes = float(units[-1].output_bytes_per_token)

        def prefix(values: Sequence[float]) -> FloatArray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))

        self._flops = prefix([u.flops_per_token for u in units])
        self._attn = prefix([u.attention_flops_per_token_per_context for u in units])
        self._blocks = prefix([1.0 if u.kind == "block" else 0.0 for u in units])
        self._heads = prefix([1.0 if u.kind == "head" else 0.0 for u in units])
        self._first_block = next((i for i, u in enumerate(units) if u.kind == "block"), None)

        idx = np.arange(self.n + 1)
        self._a, self._b = idx[:, None], idx[None, :]
        a, b = self._a, self._b
        self._valid = b > a
        self._units = (b - a).astype(np.float64)
        c = float(self.context)
        self._flops_tok = (self._flops[b] - self._flops[a]) + c * (self._attn[b] - self._attn[a])
        n_pf = float(PREFILL_TOKENS)
        self._prefill_flops = n_pf * (self._flops[b] - self._flops[a]) + (n_pf * (n_pf + 1) / 2) * (
            self._attn[b] - self._attn[a]
        )
        self._formats: dict[WeightBytes, _FormatCost] = {}
        self._default = WeightBytes.of(model)
        self._device_formats = [self._format(self._weights_of(d)) for d in self.devices]

        self._link_index: dict[tuple[str, str], LinkProfile] = {}
        for link in sorted(links, key=lambda x: (x.src, x.dst, x.measured_at_s)):
            self._link_index[(link.src, link.dst)] = link
        self._overheads = [
            constraints.unit_overhead_for(d.peer_id, d.device, d.backend) for d in self.devices
        ]
        self._scales = [self._calibration_scale(i) for i in range(len(self.devices))]
        head = next((i for i, u in enumerate(units) if u.kind == "head"), None)
        self._head_flops = float(units[head].flops_per_token) if head is not None else 0.0
        self._head = head or 0
        self._has_head = (self._heads[b] - self._heads[a]) > 0
        self._head_rates = [self._head_rate(i) for i in range(len(self.devices))]
        self._shares = [constraints.cpu_share_for(d.peer_id, d.device) for d in self.devices]
        self._matrix_cache: dict[tuple[object, ...], FloatArray] = {}
        self._device_matrix: dict[tuple[int, int], FloatArray] = {}
        self._link_cache: dict[tuple[int, int], tuple[float, float]] = {}

    # ----- weight formats ------------------------------------------------------------
    def _weights_of(self, d: DeviceProfile) -> WeightBytes:
        found = self.constraints.weights_for(d.peer_id, d.device)
        if found is None:
            return self._default
        if len(found.param_bytes) != self.n:
            raise ValueError(
                f"{device_key(d.peer_id, d.device)}: {found.weights} bytes cover "
                f"{len(found.param_bytes)} units, the model has {self.n}"
            )
        return found

    def _format(self, weights: WeightBytes) -> _FormatCost:
        """The byte matrices of one weight format (shared by the devices serving in it)."""
        cached = self._formats.get(weights)
        if cached is not None:
            return cached
        cons = self.constraints
        units = self.model.units
        a, b = self._a, self._b

        def prefix(values: Sequence[float]) -> FloatArray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))

        params = prefix([float(x) for x in weights.param_bytes])
        # the embedding reads only its looked-up rows per step: counted as zero
        read = prefix(
            [
                0.0 if u.kind == "embed" else float(x)
                for u, x in zip(units, weights.param_bytes, strict=True)
            ]
        )
        kv = prefix([float(x) for x in weights.kv_bytes_per_token])
        whole = (a == 0) & (b == self.n)
        resident_weights = (params[b] - params[a]) - np.where(whole, float(weights.tied_bytes), 0.0)
        kv_mat = kv[b] - kv[a]
        has_block = (self._blocks[b] - self._blocks[a]) > 0
        has_head = (self._heads[b] - self._heads[a]) > 0
        work = np.where(
            has_block, float(cons.prefill_chunk_tokens * _WORKSPACE_FACTOR) * self.hidden_bytes, 0.0
        ) + np.where(
            has_head,
            float(head_workspace_bytes(self.model.vocab_size, cons) + weights.head_pack_bytes),
            0.0,
        )
        budget = float(cons.max_context_tokens * cons.max_sessions) * kv_mat
        read_mat = read[b] - read[a]
        first = self._first_block
        out = _FormatCost(
            weights=weights.weights,
            resident=np.asarray(resident_weights + budget + work, dtype=np.float64),
            read=read_mat,
            kv=kv_mat,
            prefill_bytes=read_mat + float(PREFILL_TOKENS) * kv_mat,
            block_bytes=float(weights.param_bytes[first]) if first is not None else 0.0,
            block_kv_bytes=float(weights.kv_bytes_per_token[first]) if first is not None else 0.0,
        )
        self._formats[weights] = out
        return out

    def weights(self, dev: int) -> str:
        """The weight format device ``dev`` serves in."""
        return self._device_formats[dev].weights

    # ----- memory -------------------------------------------------------------------
    def reserve_bytes(self, dev: int) -> int:
        d = self.devices[dev]
        cons = self.constraints
        return max(cons.reserve_bytes, int(cons.reserve_fraction * d.memory_total_bytes))

    def stage_memory_bytes(self, dev: int, start: int, end: int) -> int:
        """Bytes a stage holding ``[start, end)`` on device ``dev`` needs, reserve included."""
        return int(self._device_formats[dev].resident[start, end]) + self.reserve_bytes(dev)

    def holds_any_unit(self, dev: int) -> bool:
        """Whether ``dev`` computes and has the memory for at least one unit."""
        diagonal = self.step_matrix(dev, 1)[np.arange(self.n), np.arange(1, self.n + 1)]
        return bool(np.isfinite(diagonal).any())

    def fits(self, dev: int, start: int, end: int) -> bool:
        return self.stage_memory_bytes(dev, start, end) <= self.devices[dev].memory_free_bytes

    def model_bytes(self) -> int:
        """Memory the whole model needs in one stage, without any reserve, in the most
        compact format any device serves in (a lower bound for a mixed mesh)."""
        return int(
            min(
                f.resident[0, self.n] for f in self._device_formats or [self._format(self._default)]
            )
        )

    def usable_bytes(self, dev: int) -> int:
        return max(0, self.devices[dev].memory_free_bytes - self.reserve_bytes(dev))

    # ----- time ---------------------------------------------------------------------
    def _calibration_scale(self, dev: int) -> float:
        """Measured ÷ modelled decode step of one block on ``dev`` (1.0 if uncalibrated)."""
        d = self.devices[dev]
        measured = self.constraints.block_step_for(d.peer_id, d.device)
        first = self._first_block
        if measured is None or first is None or d.matmul_flops <= 0 or d.memory_bandwidth_bps <= 0:
            return 1.0
        block = self.model.units[first]
        fmt = self._device_formats[dev]  # the block was timed in the device's own format
        c = float(self.constraints.calibration_context_tokens)
        compute = (
            block.flops_per_token + c * block.attention_flops_per_token_per_context
        ) / d.matmul_flops
        memory = (fmt.block_bytes + c * fmt.block_kv_bytes) / d.memory_bandwidth_bps
        modelled = max(compute, memory) + self._overheads[dev]
        return measured / modelled if modelled > 0 else 1.0

    def _head_rate(self, dev: int) -> float:
        """Seconds per FLOP of ``dev``'s measured block, its dispatch overhead taken off
        (0.0 if uncalibrated): what the head's matmul costs at the least, see
        :meth:`head_extra_s`."""
        d = self.devices[dev]
        measured = self.constraints.block_step_for(d.peer_id, d.device)
        first = self._first_block
        if measured is None or first is None:
            return 0.0
        block = self.model.units[first]
        c = float(self.constraints.calibration_context_tokens)
        flops = block.flops_per_token + c * block.attention_flops_per_token_per_context
        busy = measured - self._overheads[dev]
        return busy / flops if flops > 0 and busy > 0 else 0.0

    def head_extra_s(self, dev: int, tokens: int = 1) -> float:
        """What a step of ``tokens`` tokens through the head costs on ``dev`` beyond the
        roofline's share (0.0 where the roofline is the larger).

        The roofline scaled by the calibrated block keeps the roofline's proportions,
        so a head that reads 13 blocks' bytes costs ~13 blocks' memory time where the
        bandwidth binds, and ~4 where it measured high. A quantised head on a CPU is
        bound by its kernel's arithmetic instead (int8: one default-model head ran
        7.4 blocks' time, its FLOPs are 8 blocks'; docs/journal/2026-12-05-fast-cut.md):
        it costs at least its FLOPs at the rate the measured block ran at.
        """
        rate = self._head_rates[dev]
        if rate <= 0.0 or self._head_flops <= 0.0:
            return 0.0
        d = self.devices[dev]
        if d.matmul_flops <= 0 or d.memory_bandwidth_bps <= 0:
            return 0.0  # it computes nothing: its steps are inf anyway
        head = self._head
        t = float(tokens)
        compute = t * self._head_flops / d.matmul_flops
        memory = float(self._device_formats[dev].read[head, head + 1]) / d.memory_bandwidth_bps
        roofline = self._scales[dev] * max(compute, memory)
        return max(0.0, t * self._head_flops * rate - roofline)

    def calibration_scale(self, dev: int) -> float:
        """How much slower (> 1) or faster a measured block ran than the roofline says."""
        return self._scales[dev]

    def _signature(self, dev: int) -> tuple[str, float, float, float, int, float]:
        d = self.devices[dev]
        return (
            self._device_formats[dev].weights,
            d.matmul_flops,
            d.memory_bandwidth_bps,
            self._overheads[dev],
            self.usable_bytes(dev),
            self._scales[dev],
        )

    def step_matrix(self, dev: int, tokens: int) -> FloatArray:
        """``M[a, b]``: one step of ``tokens`` tokens over ``[a, b)`` on ``dev``; inf if unfit."""
        mine = self._device_matrix.get((dev, tokens))
        if mine is not None:
            return mine
        sig = (*self._signature(dev), tokens)
        cached = self._matrix_cache.get(sig)
        if cached is not None:
            self._device_matrix[(dev, tokens)] = cached
            return cached
        _, flops, bandwidth, overhead, usable, scale = sig[:6]
        fmt = self._device_formats[dev]
        if flops <= 0 or bandwidth <= 0:
            out = np.full((self.n + 1, self.n + 1), INF)
        else:
            t = float(tokens)
            compute = t * self._flops_tok / flops
            memory = (fmt.read + t * self.context * fmt.kv) / bandwidth
            out = (
                scale * (np.maximum(compute, memory) + self._units * overhead)
                + self._stage_overhead
                + np.where(self._has_head, self.head_extra_s(dev, tokens), 0.0)
            )
            out = np.where(self._valid & (fmt.resident <= usable), out, INF)
        self._matrix_cache[sig] = out
        self._device_matrix[(dev, tokens)] = out
        return out

    def step_s(self, dev: int, start: int, end: int, tokens: int = 1) -> float:
        """One decode step of ``tokens`` tokens over ``[start, end)`` (ignores memory)."""
        d = self.devices[dev]
        if d.matmul_flops <= 0 or d.memory_bandwidth_bps <= 0:
            return INF
        fmt = self._device_formats[dev]
        compute = tokens * float(self._flops_tok[start, end]) / d.matmul_flops
        memory = (
            float(fmt.read[start, end]) + tokens * self.context * float(fmt.kv[start, end])
        ) / d.memory_bandwidth_bps
        head = self.head_extra_s(dev, tokens) if self._has_head[start, end] else 0.0
        return (
            self._scales[dev] * (max(compute, memory) + (end - start) * self._overheads[dev])
            + self.stage_overhead_s(start, end)
            + head
        )

    def burst_step_s(self, dev: int, start: int, end: int) -> float:
        """One decode step over ``[start, end)`` on ``dev`` while the device is otherwise
        idle: its compute at a whole core where a quota holds it to a share of one
        (the sustained :meth:`step_s` scaled by that share), its overhead as is."""
        overhead = self.stage_overhead_s(start, end)
        return self._shares[dev] * (self.step_s(dev, start, end) - overhead) + overhead

    def cpu_share(self, dev: int) -> float:
        """The share of one core ``dev``'s quota allows (1.0: a core or more)."""
        return self._shares[dev]

    def stage_overhead_s(self, start: int, end: int) -> float:
        """What a decode step over ``[start, end)`` pays outside its compute
        (``PlanConstraints.stage_overhead_s``). A stage holding the whole model feeds
        itself (``PlanConstraints.feed_steps``): it pays that once a feed, and its
        forwards run back to back in between."""
        overhead = self.constraints.stage_overhead_s
        return overhead / self.constraints.feed_steps if (start, end) == (0, self.n) else overhead

    def prefill_s(self, dev: int, start: int, end: int) -> float:
        """A 1,000-token prompt through ``[start, end)`` on ``dev``."""
        d = self.devices[dev]
        if d.matmul_flops <= 0 or d.memory_bandwidth_bps <= 0:
            return INF
        compute = float(self._prefill_flops[start, end]) / d.matmul_flops
        memory = float(self._device_formats[dev].prefill_bytes[start, end]) / d.memory_bandwidth_bps
        return (
            max(compute, memory)
            + (end - start) * self._overheads[dev]
            + self.constraints.stage_overhead_s
        )

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """``(rtt_s, bandwidth_bps)`` from device ``src`` to device ``dst``."""
        cached = self._link_cache.get((src, dst))
        if cached is not None:
            return cached
        cons = self.constraints
        s, d = self.devices[src], self.devices[dst]
        if src == dst:
            out = (0.0, INF)
        elif s.peer_id == d.peer_id:
            out = (cons.same_host_rtt_s, cons.same_host_bandwidth_bps)
        else:
            # this direction's measurement, else the other's; the RTT is a round trip over
            # the same path either way, and a probe queued behind traffic or a starved
            # CPU only ever reads it longer: the lower of the two
            measured = [
                x
                for x in (
                    self._link_index.get((s.peer_id, d.peer_id)),
                    self._link_index.get((d.peer_id, s.peer_id)),
                )
                if x is not None and x.bandwidth_bps > 0
            ]
            if measured:
                out = (min(x.rtt_s for x in measured), measured[0].bandwidth_bps)
            else:
                out = (cons.default_rtt_s, cons.default_bandwidth_bps)
        self._link_cache[(src, dst)] = out
        return out

    def measured_links(self) -> list[LinkProfile]:
        """The measured links, one per direction, in canonical order."""
        return [self._link_index[k] for k in sorted(self._link_index)]

    def link_latency_s(self, src: int, dst: int, nbytes: float | None = None) -> float:
        """One message of ``nbytes`` (default: one token's activation): bytes/bw + RTT/2."""
        if src == dst:
            return 0.0
        rtt, bandwidth = self.link(src, dst)
        return (self.hidden_bytes if nbytes is None else nbytes) / bandwidth + rtt / 2

    def link_occupancy_s(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst:
            return 0.0
        return nbytes / self.link(src, dst)[1]

    def return_latency_s(self, last: int, first: int) -> float:
        return self.link_latency_s(last, first, self.token_bytes)

    # ----- whole pipelines ----------------------------------------------------------
    def pipeline(self, stages: Sequence[Assignment]) -> Pipeline:
        """The predictions for an assignment (contiguous, starting at unit 0)."""
        t = self.constraints.micro_batch_tokens
        records: list[Stage] = []
        latency = prefill = bottleneck = sustained = 0.0
        for i, st in enumerate(stages):
            nxt = stages[i + 1].device if i + 1 < len(stages) else None
            sustained = max(sustained, self.step_s(st.device, st.start, st.end, 1))
            step = self.burst_step_s(st.device, st.start, st.end)
            batch = self.step_s(st.device, st.start, st.end, t)
            pre = self.prefill_s(st.device, st.start, st.end)
            if nxt is None:
                link_out = self.return_latency_s(st.device, stages[0].device)
                occupancy = self.link_occupancy_s(st.device, stages[0].device, t * self.token_bytes)
                pre_link = 0.0
            else:
                link_out = self.link_latency_s(st.device, nxt)
                occupancy = self.link_occupancy_s(st.device, nxt, t * self.hidden_bytes)
                pre_link = self.link_latency_s(st.device, nxt, PREFILL_TOKENS * self.hidden_bytes)
            latency += step + link_out
            prefill += pre + pre_link
            bottleneck = max(bottleneck, batch, occupancy)
            d = self.devices[st.device]
            records.append(
                Stage(
                    peer_id=d.peer_id,
                    device=d.device,
                    start=st.start,
                    end=st.end,
                    decode_step_s=step,
                    batch_step_s=batch,
                    prefill_s_per_1k=pre,
                    link_out_s=link_out,
                    memory_bytes=self.stage_memory_bytes(st.device, st.start, st.end),
                    weights=self.weights(st.device),
                )
            )
        return Pipeline(
            stages=tuple(records),
            decode_latency_s=max(latency, sustained),
            prefill_s_per_1k=prefill,
            bottleneck_s=bottleneck,
            throughput_tps=(t / bottleneck) if bottleneck > 0 else INF,
        )

    def feasible(self, stages: Sequence[Assignment]) -> bool:
        return all(self.fits(s.device, s.start, s.end) for s in stages)


def objective_value(pipelines: Sequence[Pipeline], objective: Objective) -> float:
    """Latency: the best pipeline's seconds per token. Throughput: total tokens/s."""
    if objective == "latency":
        return min(p.decode_latency_s for p in pipelines)
    return sum(p.throughput_tps for p in pipelines)


def better(a: float, b: float, objective: Objective) -> bool:
    """Whether objective value ``a`` beats ``b``."""
    return a < b if objective == "latency" else a > b


__all__ = [
    "PREFILL_TOKENS",
    "Assignment",
    "CostModel",
    "better",
    "head_workspace_bytes",
    "objective_value",
    "sort_devices",
]
