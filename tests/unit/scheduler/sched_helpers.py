"""Small builders for scheduler tests: devices, links and model shapes by hand."""

from __future__ import annotations

from hetmesh.partition.profile import llama_like_config, model_profile
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile
from hetmesh.scheduler import PlanConstraints
from hetmesh.scheduler.records import Pipeline, Plan, Stage

GIB = 1024**3

# No reserve, no per-stage overhead surprises: hand-checkable numbers.
BARE = PlanConstraints(
    max_context_tokens=256,
    reserve_bytes=0,
    reserve_fraction=0.0,
    stage_overhead_s=0.0,
    unit_overhead_s={"cpu": 0.0, "cuda": 0.0, "mps": 0.0},
)


def device(
    peer: str,
    *,
    memory: int = 8 * GIB,
    flops: float = 1e13,
    bandwidth: float = 1e11,
    backend: str = "cuda",
    name: str = "",
) -> DeviceProfile:
    return DeviceProfile(
        peer_id=peer,
        device="cpu" if backend == "cpu" else "cuda:0",
        backend="cpu" if backend == "cpu" else "cuda",
        name=name or peer,
        memory_total_bytes=memory,
        memory_free_bytes=memory,
        matmul_flops=flops,
        memory_bandwidth_bps=bandwidth,
    )


def full_links(
    devices: list[DeviceProfile], *, bandwidth: float = 1.25e9, rtt: float = 2e-4
) -> list[LinkProfile]:
    return [
        LinkProfile(src=a.peer_id, dst=b.peer_id, rtt_s=rtt, bandwidth_bps=bandwidth)
        for a in devices
        for b in devices
        if a.peer_id != b.peer_id
    ]


def toy_model(layers: int = 8, hidden: int = 512, vocab: int = 4096) -> ModelProfile:
    config = llama_like_config(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=vocab,
        max_position_embeddings=2048,
    )
    return model_profile(config, dtype="float16", name=f"toy-{layers}")


def toy_cpu_model(layers: int = 6) -> ModelProfile:
    """A small llama in float32 (256 wide, 4 heads, 2,048 words), named ``toy``."""
    config = llama_like_config(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=512,
    )
    return model_profile(config, dtype="float32", name="toy")


def cpu_device(peer: str, memory: int = 4 * GIB) -> DeviceProfile:
    """A modest CPU: 50 GFLOP/s, 20 GB/s."""
    return device(peer, memory=memory, flops=5e10, bandwidth=2e10, backend="cpu")


def hand_stage(
    peer: str, start: int, end: int, device: str = "cpu", *, step_s: float = 0.01
) -> Stage:
    """A planned stage with small fixed costs, for tests of what reads plans (routing,
    readiness) rather than of the planner."""
    return Stage(
        peer_id=peer,
        device=device,
        start=start,
        end=end,
        decode_step_s=step_s,
        batch_step_s=step_s,
        prefill_s_per_1k=0.1,
        link_out_s=0.001,
        memory_bytes=1,
    )


def hand_pipeline(*stages: Stage) -> Pipeline:
    """A pipeline of hand-made stages (its own figures are placeholders)."""
    return Pipeline(
        stages=stages,
        decode_latency_s=0.02,
        prefill_s_per_1k=0.2,
        bottleneck_s=0.01,
        throughput_tps=50.0,
    )


def hand_plan(*pipelines: Pipeline, epoch: int = 1) -> Plan:
    """A plan of hand-made pipelines, of model ``m`` (its own figures are placeholders)."""
    return Plan(
        epoch=epoch,
        model_name="m",
        objective="latency",
        strategy="exact",
        pipelines=pipelines,
        objective_value=0.02,
        decode_latency_s=0.02,
        prefill_s_per_1k=0.2,
        throughput_tps=50.0,
    )
