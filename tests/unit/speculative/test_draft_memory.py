"""A draft model at the gateway (``--draft FORMAT``) is the node's memory: the cap the
node offers the planner drops by its bytes (weights and its sessions' KV), so the
planner does not place a stage that no longer fits beside it (issue 48)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hetmesh.discovery.profiling import Benchmark, device_profiles
from hetmesh.node.memory import offered_cap
from hetmesh.node.serving import Serving
from hetmesh.speculative.draft_model import DraftModel

MIB = 1 << 20
BENCH = Benchmark(matmul_flops=1e10, memory_bandwidth_bps=1e10, measured_at_s=0.0, key="t")


def _offered(cap: int, beside: int) -> int:
    (cpu,) = device_profiles("peer", BENCH, max_memory_bytes=offered_cap(cap, beside), only="cpu")
    assert cpu.memory_total_bytes == cpu.memory_free_bytes  # the cap binds, not the host
    return cpu.memory_free_bytes


def test_the_offered_memory_drops_by_the_draft_models_bytes(tiny_model_dir: Path) -> None:
    model = DraftModel.load(tiny_model_dir, weights="float32")
    serving = SimpleNamespace(draft_model=None)
    assert Serving.beside_plan_bytes(serving) == 0  # prompt lookup holds nothing
    cap = 256 * MIB
    plain = _offered(cap, 0)
    assert plain == cap
    serving.draft_model = model
    weights = Serving.beside_plan_bytes(serving)
    assert weights == model.weight_bytes() > 0
    assert _offered(cap, weights) == cap - weights
    drafter = model.drafter()
    drafter.propose(list(range(1, 40)), 4)  # a session's KV, held in the draft model
    held = Serving.beside_plan_bytes(serving)
    assert held > weights
    assert _offered(cap, held) == cap - held
    drafter.close()
    assert Serving.beside_plan_bytes(serving) == weights


def test_without_a_cap_the_host_figures_stand() -> None:
    assert offered_cap(None, 123 * MIB) is None
    assert offered_cap(100 * MIB, 300 * MIB) == 0  # never below nothing
