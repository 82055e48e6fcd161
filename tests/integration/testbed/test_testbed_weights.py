"""Compact weights lift the memory limit: three capped hosts refuse fp32 and serve int8.

Three emulated hosts, each under a cgroup memory limit and offering the
planner what that limit leaves after the node's own runtime. In float32 (and
bfloat16) the model fits nowhere on the mesh: a request is refused up front
with ``InsufficientCapacity`` naming the format. The same hosts started with
``--weights int8`` serve it, token for token as one process holding the
model in int8, every host's cgroup peak under its limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetmesh.testbed.mesh import REPO, HostSpec, MakeTestbed, MeshTestbed, child_env, plan_of

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(420),
]

MIB = 1 << 20
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 12
# the announced block step skips calibration: this test is about memory, not speed
NODE_ARGS = ("--max-sessions", "4", "--max-context", "256", "--block-step-ms", "2")
# Per host: float32 and bfloat16 need more than three such offers (planner
# arithmetic, checked below), int8 fits in them; the limit adds the node's runtime.
# (200 MiB held bf16 in three, and 170 int8 in two, once the head stage was charged its
# sampled rows of logits, not 512 prompt rows of them.)
OFFER = "160MiB"
LIMIT = 560 * MIB

_REFERENCE = """
import json, sys, torch
torch.set_num_threads(1)
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import resolve_model
from hetmesh.partition.text import encode_prompt, load_tokenizer
model = resolve_model()
pipe = LocalPipeline.load(model, 1, weights=sys.argv[3])
tokenizer = load_tokenizer(model)
out = {"prompts": [], "tokens": []}
for prompt in json.loads(sys.argv[1]):
    ids = encode_prompt(tokenizer, prompt)
    out["prompts"].append(ids)
    params = SamplingParams(max_new_tokens=int(sys.argv[2]))
    out["tokens"].append(list(pipe.generate_ids(ids, params)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def int8_reference(default_model_dir: Path) -> dict[str, Any]:
    """Greedy tokens of one process holding the whole model in int8."""
    out = subprocess.run(
        [sys.executable, "-c", _REFERENCE, json.dumps(PROMPTS), str(NEW_TOKENS), "int8"],
        capture_output=True,
        env=child_env(),
        cwd=str(REPO),
        timeout=240,
        check=True,
    )
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _cgroup_peak(bed: MeshTestbed, host: int) -> int:
    """The host's peak memory as its cgroup recorded it (v1 or v2)."""
    for cg in bed.net.hosts[host].cgroups:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            path = Path(cg) / name
            if path.is_file():
                return int(path.read_text())
    raise AssertionError(f"host {host} has no memory cgroup")


def test_float_formats_do_not_fit_the_offers_and_int8_does() -> None:
    """The planner arithmetic the testbed test rests on (pure, no processes)."""
    from hetmesh.cli.node import parse_size
    from hetmesh.errors import InsufficientCapacity
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.profile import KNOWN_SHAPES, model_profile
    from hetmesh.resources import DeviceProfile
    from hetmesh.scheduler import PlanConstraints, plan

    config = KNOWN_SHAPES["smollm2-135m"]
    offer = parse_size(OFFER)
    devices = [
        DeviceProfile(
            peer_id=p,
            device="cpu",
            backend="cpu",
            name=p,
            memory_total_bytes=offer,
            memory_free_bytes=offer,
            matmul_flops=1e11,
            memory_bandwidth_bps=1e10,
        )
        for p in "abc"
    ]

    def constraints(weights: str) -> PlanConstraints:
        held = weight_bytes(config, weights, name="m")
        return PlanConstraints(
            max_context_tokens=256,
            max_sessions=4,
            reserve_bytes=64 * MIB,
            weights_by_device={f"{p}/cpu": held for p in "abc"},
        )

    model = model_profile(config, name="m")
    for weights in ("float32", "bfloat16"):
        with pytest.raises(InsufficientCapacity, match=weights):
            plan(devices, [], model, constraints=constraints(weights))
    assert plan(devices, [], model, constraints=constraints("int8")).pipelines


def test_three_capped_hosts_refuse_float32_and_serve_int8_exactly(
    mesh_testbed: MakeTestbed, int8_reference: dict[str, Any]
) -> None:
    bed = mesh_testbed([HostSpec(memory_limit_bytes=LIMIT, max_memory=OFFER) for _ in range(3)])

    bed.start_all(*NODE_ARGS, "--weights", "float32")
    (answer,) = bed.generate(int8_reference["prompts"][0], NEW_TOKENS, timeout_s=90)
    assert answer.get("error") == "InsufficientCapacity", answer
    assert "float32 weights" in answer["message"]
    assert "does not fit" in answer["message"]
    assert "--weights bfloat16, int8 or int4" in answer["message"]  # what to try
    for node in bed.nodes:
        assert node.proc.poll() is None, f"host {node.host} died:\n{node.log()[-2000:]}"
        assert "loading units" not in node.log()
    bed.stop_nodes()

    bed.start_all(*NODE_ARGS, "--weights", "int8")
    view = bed.wait_serving()
    plan = plan_of(view)
    stages = plan.pipelines[0].stages
    assert len({s.peer_id for s in stages}) == 3  # the model needs all three hosts
    assert {s.weights for s in stages} == {"int8"}
    for ids, want in zip(int8_reference["prompts"], int8_reference["tokens"], strict=True):
        (got,) = bed.generate(ids, NEW_TOKENS)
        assert "error" not in got, got
        assert got["tokens"] == want
    for node in bed.nodes:
        assert node.proc.poll() is None, f"host {node.host} died:\n{node.log()[-2000:]}"
        peak = _cgroup_peak(bed, node.host)
        print(f"host {node.host}: cgroup peak {peak / MIB:.0f} MiB of {LIMIT / MIB:.0f} MiB")
        assert peak < LIMIT
