"""The cost model by hand: step times, memory, links, tied embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
from hetmesh.resources import LinkProfile
from hetmesh.scheduler import PlanConstraints
from hetmesh.scheduler.cost import Assignment, CostModel
from tests.unit.scheduler.sched_helpers import BARE, device, toy_model


def test_block_step_is_max_of_compute_and_memory_plus_overheads() -> None:
    m = toy_model(2)
    block = m.units[1]
    cons = PlanConstraints(
        max_context_tokens=256,
        stage_overhead_s=5e-4,
        unit_overhead_s={"cuda": 1e-4},
        reserve_bytes=0,
        reserve_fraction=0.0,
    )
    cost = CostModel(m, [device("a", flops=1e12, bandwidth=1e11)], [], cons)
    assert cost.context == 128
    compute = block.decode_flops(128) / 1e12
    memory = (block.param_bytes + 128 * block.kv_bytes_per_token) / 1e11
    assert memory > compute  # decode is memory-bound here
    assert cost.step_s(0, 1, 2) == pytest.approx(memory + 1e-4 + 5e-4)
    # 64 tokens in one micro-batch: weights read once, compute 64×
    batch = max(64 * compute, (block.param_bytes + 64 * 128 * block.kv_bytes_per_token) / 1e11)
    assert cost.step_s(0, 1, 2, tokens=64) == pytest.approx(batch + 6e-4)


def test_step_matrix_matches_scalar_and_marks_unfit_ranges() -> None:
    m = toy_model(4)
    need = CostModel(m, [device("x")], [], BARE).model_bytes()
    cost = CostModel(m, [device("a", memory=need // 2)], [], BARE)
    matrix = cost.step_matrix(0, 1)
    for a in range(m.num_units):
        for b in range(a + 1, m.num_units + 1):
            if cost.fits(0, a, b):
                assert matrix[a, b] == pytest.approx(cost.step_s(0, a, b))
            else:
                assert matrix[a, b] == np.inf
    assert matrix[0, m.num_units] == np.inf
    assert np.all(matrix[np.tril_indices(m.num_units + 1)] == np.inf)  # empty ranges


def test_memory_counts_weights_kv_workspace_and_reserve() -> None:
    m = toy_model(4)
    cons = PlanConstraints(
        max_context_tokens=1000, max_sessions=3, prefill_chunk_tokens=10, reserve_bytes=7
    )
    cost = CostModel(m, [device("a", memory=1 << 40)], [], cons)
    block = m.units[2]
    expected = (
        block.param_bytes
        + 3000 * block.kv_bytes_per_token
        + 10 * 8 * block.input_bytes_per_token
        + max(7, int(0.05 * (1 << 40)))
    )
    assert cost.stage_memory_bytes(0, 2, 3) == expected


def test_tied_embedding_counted_once_only_when_one_stage_holds_both_ends() -> None:
    m = model_profile(KNOWN_SHAPES["smollm2-135m"], name="smollm2")
    cost = CostModel(m, [device("a", memory=1 << 40)], [], BARE)
    n = m.num_units
    whole = cost.stage_memory_bytes(0, 0, n)
    split = cost.stage_memory_bytes(0, 0, 1) + cost.stage_memory_bytes(0, 1, n)
    tied = m.vocab_size * m.hidden_size * 4
    kv_work = split - (m.units[0].param_bytes + sum(u.param_bytes for u in m.units[1:]))
    assert whole - kv_work == m.total_param_bytes
    assert split - whole == tied  # the second stage loads the shared matrix again


def test_links_measured_same_host_and_default() -> None:
    m = toy_model(2)
    devs = [device("a"), device("b"), device("c")]
    cuda1 = device("a").to_wire() | {"device": "cuda:1"}
    from hetmesh.resources import DeviceProfile

    devs.append(DeviceProfile.from_wire(cuda1))
    links = [LinkProfile(src="a", dst="b", rtt_s=0.01, bandwidth_bps=1e6)]
    cost = CostModel(m, devs, links, BARE)
    index = {(d.peer_id, d.device): i for i, d in enumerate(cost.devices)}
    a0, a1 = index[("a", "cuda:0")], index[("a", "cuda:1")]
    b, c = index[("b", "cuda:0")], index[("c", "cuda:0")]
    hidden = 512 * 2
    assert cost.link_latency_s(a0, b) == pytest.approx(hidden / 1e6 + 0.005)
    assert cost.link_latency_s(b, a0) == pytest.approx(hidden / 1e6 + 0.005)  # reverse used
    assert cost.link(a0, a1) == (BARE.same_host_rtt_s, BARE.same_host_bandwidth_bps)
    assert cost.link(a0, c) == (BARE.default_rtt_s, BARE.default_bandwidth_bps)
    assert cost.return_latency_s(b, a0) == pytest.approx(8 / 1e6 + 0.005)


def test_pipeline_prediction_sums_latency_and_takes_bottleneck() -> None:
    m = toy_model(4)
    devs = [device("a"), device("b", bandwidth=5e10)]
    links = [
        LinkProfile(src="a", dst="b", rtt_s=0.002, bandwidth_bps=1e7),
        LinkProfile(src="b", dst="a", rtt_s=0.002, bandwidth_bps=1e7),
    ]
    cost = CostModel(m, devs, links, BARE)
    stages = [Assignment(0, 0, 3), Assignment(1, 3, m.num_units)]
    pipe = cost.pipeline(stages)
    s0, s1 = cost.step_s(0, 0, 3), cost.step_s(1, 3, m.num_units)
    hop, back = cost.link_latency_s(0, 1), cost.return_latency_s(1, 0)
    assert pipe.decode_latency_s == pytest.approx(s0 + hop + s1 + back)
    assert pipe.bottleneck_s == pytest.approx(max(s0, s1, 1024 / 1e7))
    assert pipe.throughput_tps == pytest.approx(1 / pipe.bottleneck_s)


def test_per_device_overhead_override() -> None:
    m = toy_model(2)
    cons = PlanConstraints(unit_overhead_s_by_device={"a/cuda:0": 0.01}, stage_overhead_s=0.0)
    cost = CostModel(m, [device("a"), device("b")], [], cons)
    base = CostModel(m, [device("a"), device("b")], [], PlanConstraints(stage_overhead_s=0.0))
    assert cost.step_s(0, 1, 3) - base.step_s(0, 1, 3) == pytest.approx(2 * (0.01 - 4e-5))
    assert cost.step_s(1, 1, 3) == pytest.approx(base.step_s(1, 1, 3))
