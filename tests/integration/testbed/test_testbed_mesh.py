"""Real node processes on emulated heterogeneous hosts (hetmesh/testbed/mesh.py).

- a heterogeneous mesh: CPU quotas of 100%, 50% and 25%, one link at 50 Mbit;
  the nodes measure themselves, the planner gives the slow host less work,
  and greedy output equals the single-process reference;
- a model that fits no single host: under a memory limit below what the whole
  model needs at run time, one node refuses up front (InsufficientCapacity,
  alive, not OOM-killed) while three such hosts serve it exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetmesh.partition.profile import model_profile
from hetmesh.partition.store import check_model_dir
from hetmesh.testbed.cgroups import MEMORY_PEAK, detect
from hetmesh.testbed.mesh import (
    REPO,
    HostSpec,
    MakeTestbed,
    MeshTestbed,
    child_env,
    devices_of,
    plan_of,
    wait_for,
)

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
# float32: the hosts' memory is sized so that its weights need them all (the default
# model's own int4 would fit one; test_testbed_weights.py covers the compact formats)
NODE_ARGS = ("--max-sessions", "4", "--max-context", "256", "--weights", "float32")
# the memory test announces a block step instead of calibrating (four calibrations of
# the model under a memory limit, none of which its assertions read): it is about memory
MEMORY_ARGS = (*NODE_ARGS, "--block-step-ms", "2")

_REFERENCE = """
import json, resource, sys, torch
torch.set_num_threads(1)
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.store import resolve_model
pipe = LocalPipeline.load(resolve_model(), weights="float32")
out = {"prompts": [], "tokens": []}
for prompt in json.loads(sys.argv[1]):
    ids = pipe.tokenizer.encode(prompt)
    out["prompts"].append(ids)
    params = SamplingParams(max_new_tokens=int(sys.argv[2]))
    out["tokens"].append(list(pipe.generate_ids(ids, params)))
out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> dict[str, Any]:
    """Greedy tokens of the whole model in one process, and that process's peak memory."""
    out = subprocess.run(
        [sys.executable, "-c", _REFERENCE, json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True,
        env=child_env(),
        cwd=str(REPO),
        timeout=180,
        check=True,
    )
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _assert_same_as_reference(bed: MeshTestbed, reference: dict[str, Any]) -> None:
    for ids, want in zip(reference["prompts"], reference["tokens"], strict=True):
        (got,) = bed.generate(ids, NEW_TOKENS)
        assert "error" not in got, got
        assert got["tokens"] == want


def test_heterogeneous_mesh_gives_the_slow_host_less_work(
    mesh_testbed: MakeTestbed, reference: dict[str, Any], default_model_dir: Path
) -> None:
    bed = mesh_testbed(
        [
            HostSpec(cpu=1.0, max_memory="350MiB"),
            HostSpec(cpu=0.5, max_memory="350MiB"),
            HostSpec(cpu=0.25, max_memory="350MiB", rate="50mbit"),
        ]
    )
    bed.start_all(*NODE_ARGS)
    view = bed.wait_serving()
    plan = plan_of(view)
    hosts = bed.peer_host()
    flops = {hosts[p]: float(d["matmul_flops"]) for p, d in devices_of(view).items()}
    profile = model_profile(check_model_dir(default_model_dir))
    units = {h: 0 for h in hosts.values()}
    work = {h: 0.0 for h in hosts.values()}  # FLOPs per decoded token: the head weighs most
    for stage in plan.pipelines[0].stages:
        units[hosts[stage.peer_id]] += stage.end - stage.start
        work[hosts[stage.peer_id]] += sum(
            u.flops_per_token for u in profile.units[stage.start : stage.end]
        )
    calibrated = {
        hosts[k.split("/")[0]]: v for k, v in plan.constraints.block_step_s_by_device.items()
    }
    print(f"FLOP/s {flops}, block step {calibrated}, units {units}, work {work}")
    slowest = min(flops, key=flops.__getitem__)
    assert slowest == 2  # the 25% quota measured as the slowest
    assert set(calibrated) == {0, 1, 2}  # every node's measured block step reached the plan
    assert calibrated[2] > calibrated[0]
    # the fastest as the planner sees it: the shortest calibrated block step (the
    # 100% and 50% hosts' FLOP/s can swap places when the machine is busy)
    fastest = min(calibrated, key=calibrated.__getitem__)
    assert sum(units.values()) == plan.pipelines[0].num_units
    # 350 MiB each: no two hosts hold the model, so all three serve, the slow one least
    assert all(units[h] > 0 for h in (0, 1, 2))
    assert units[slowest] < units[fastest]
    assert work[slowest] == min(work.values())
    assert work[slowest] < work[fastest]

    # the shaped link is measured as such (probes ride each host's access link)
    limited = 6.25e6  # 50 Mbit/s in bytes/s
    measured: dict[tuple[int, int], float] = {}

    def links_settled() -> bool:
        # each node publishes the best of its recent probes: the first ones, taken
        # while the nodes were still loading and calibrating, may be off
        measured.clear()
        measured.update(
            {
                (hosts[lk["src"]], hosts[lk["dst"]]): float(lk["bandwidth_bps"])
                for lk in bed.status()["links"]
                if lk["src"] in hosts and lk["dst"] in hosts
            }
        )
        return len(measured) == 6 and all(
            bw <= 1.3 * limited if 2 in key else bw >= 2 * limited for key, bw in measured.items()
        )

    try:
        wait_for(links_settled, 150, "all six links to be measured within bounds", every_s=2.0)
    finally:
        print({f"{s}->{d}": round(bw / 1e6, 1) for (s, d), bw in measured.items()})
    assert all(bw <= 1.3 * limited for (s, d), bw in measured.items() if 2 in (s, d))
    assert all(bw >= 2 * limited for (s, d), bw in measured.items() if 2 not in (s, d))

    _assert_same_as_reference(bed, reference)


LIMIT = 800 * MIB  # per host: below the whole model at run time, above a third of it
OFFER = "450MiB"  # what each node offers the planner: the limit less the node's own runtime


def _cgroup_peak(bed: MeshTestbed, host: int) -> int:
    hierarchy = detect()
    assert hierarchy is not None
    return hierarchy.memory_peak_bytes(bed.net.hosts[host].cgroups)


def test_model_that_fits_no_single_host_is_refused_alone_and_served_by_three(
    mesh_testbed: MakeTestbed, reference: dict[str, Any]
) -> None:
    hierarchy = detect()
    reason = hierarchy.missing([MEMORY_PEAK]) if hierarchy else "needs cgroups"
    if reason:
        pytest.skip(reason)
    bed = mesh_testbed([HostSpec(memory_limit_bytes=LIMIT, max_memory=OFFER) for _ in range(3)])
    assert reference["max_rss_bytes"] > LIMIT, "the whole model must not fit one host"

    alone = bed.start_node(0, *MEMORY_ARGS).wait_up(120)
    refusal = wait_for(
        lambda: "cannot place" in alone.log() and alone.log(),
        60,
        "the lone node to say it cannot place the model",
    )
    assert "more free memory is needed" in refusal
    (answer,) = bed.generate(reference["prompts"][0], NEW_TOKENS, timeout_s=60)
    assert answer["error"] == "InsufficientCapacity", answer
    assert "more free memory is needed" in answer["message"]
    assert answer["elapsed_s"] < 10  # up front, not after a routing timeout
    assert alone.proc.poll() is None  # refused, not killed
    assert "loading units" not in alone.log()
    bed.stop_nodes()

    bed.start_all(*MEMORY_ARGS)
    view = bed.wait_serving()
    plan = plan_of(view)
    assert len({s.peer_id for s in plan.pipelines[0].stages}) >= 2
    _assert_same_as_reference(bed, reference)
    for node in bed.nodes:
        assert node.proc.poll() is None, f"host {node.host} died:\n{node.log()[-2000:]}"
        assert _cgroup_peak(bed, node.host) < LIMIT
