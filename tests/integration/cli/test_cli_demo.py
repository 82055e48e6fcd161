"""``hetmesh demo``, the README's first command, and the ``local_mesh`` helpers behind it."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hetmesh.cli.demo import DEMO_WEIGHTS
from hetmesh.discovery.profiling import CACHE_FILE
from hetmesh.errors import MeshError, RequestTimeout
from hetmesh.scheduler.replan import newest_in_view
from hetmesh.testbed.local_mesh import local_mesh, ready_pipelines, wait_serving, wait_settled

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROMPT = "Name a large animal."
TOKENS = 12


def _hetmesh() -> list[str]:
    """The installed ``hetmesh`` script beside this interpreter, as the README runs it."""
    script = Path(sys.executable).with_name("hetmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetmesh"]


def _processes_under(root: Path) -> list[psutil.Process]:
    """Live processes whose command line mentions ``root`` (node data dirs live there)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            mentioned = any(str(root) in part for part in proc.info["cmdline"] or ())
            if mentioned and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.model
@pytest.mark.timeout(420)
def test_demo_streams_the_reference_answer_shows_the_mesh_and_stops_it(
    tmp_path: Path, default_model_dir: Path
) -> None:
    import torch

    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.text import encode_prompt

    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(default_model_dir, 1, weights=DEMO_WEIGHTS)  # the demo's
    ids = encode_prompt(pipeline.tokenizer, PROMPT, chat=True)
    reference = list(pipeline.generate_ids(ids, SamplingParams(max_new_tokens=TOKENS)))
    expected = pipeline.tokenizer.decode(reference, skip_special_tokens=True)

    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the demo's node directories land here
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HETMESH_MESH_SECRET", None)
    done = subprocess.run(
        [*_hetmesh(), "demo", PROMPT, "--max-new-tokens", str(TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(repo),
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith(f"> {PROMPT}\n{expected}\n"), done.stdout
    table = done.stdout.split(expected, 1)[1]
    assert "plan epoch" in table
    assert table.count("alive") + table.count("self") >= 3  # the three nodes
    assert "starting 3 nodes" in done.stderr
    # no node can hold the model: the plan is one pipeline cut into 3 stages, a node each
    (cut,) = [line for line in done.stderr.splitlines() if line.startswith("cut into")]
    assert cut.startswith("cut into 3 stages: node")
    ranges = re.findall(r"(node\d) \[(\d+), (\d+)\)", cut)
    assert len({node for node, _, _ in ranges}) == 3
    bounds = [(int(a), int(b)) for _, a, b in ranges]
    assert bounds[0][0] == 0
    assert all(x[1] == y[0] for x, y in itertools.pairwise(bounds))
    assert bounds[-1][1] == pipeline.stages[0].profile.num_units
    assert "whole model" not in done.stderr
    assert done.stderr.rstrip().endswith("done")
    # every node process is gone and so is the temporary mesh directory
    assert _processes_under(tmp_path) == []
    assert not any(tmp_path.glob("hetmesh-*")), list(tmp_path.iterdir())


def test_local_mesh_reports_a_node_that_cannot_start_and_reaps_it(tmp_path: Path) -> None:
    with (
        pytest.raises(MeshError, match="max-sessions must be at least 1"),
        local_mesh(2, node_args=["--no-serve", "--max-sessions", "0"], root=tmp_path),
    ):
        pass
    assert _processes_under(tmp_path) == []


def test_wait_serving_times_out_on_a_node_without_a_model_and_sees_it_die(
    tmp_path: Path,
) -> None:
    with local_mesh(2, node_args=["--no-serve"], root=tmp_path) as mesh:
        assert mesh.addr == mesh.nodes[0].addr
        assert mesh.addr.endswith(f"/p2p/{mesh.nodes[0].peer_id}")
        # the second node started from the first one's CPU benchmark and kept it (a
        # benchmark of its own would have stored a new measurement time)
        first, second = (json.loads((n.data_dir / CACHE_FILE).read_text()) for n in mesh.nodes)
        assert first
        assert second == first
        with pytest.raises(RequestTimeout, match="did not serve within 3 s"):
            wait_serving(mesh, timeout_s=3)
        with pytest.raises(RequestTimeout, match="did not settle within 2 s"):
            wait_settled(mesh, timeout_s=2)  # no plan: nothing to settle on
        mesh.nodes[0].proc.kill()
        with pytest.raises(MeshError, match="a node exited"):
            wait_serving(mesh, timeout_s=60)
    assert _processes_under(tmp_path) == []
    assert all(node.proc.returncode is not None for node in mesh.nodes)


@pytest.mark.model
def test_wait_settled_returns_once_every_planned_pipeline_is_ready_and_stays(
    tmp_path: Path,
) -> None:
    # int4 with fp16 KV fits one node: the plan grows a standby replica on the other,
    # which is loaded only after the first pipeline serves
    args = ["--max-memory", "500MiB", "--max-context", "1024", "--max-sessions", "8"]
    with local_mesh(2, node_args=args, root=tmp_path) as mesh:
        view = wait_settled(mesh, quiet_s=2.0, timeout_s=240)
        plan = newest_in_view(view)
        assert plan is not None
        assert ready_pipelines(view) == len(plan.pipelines) == 2


@pytest.mark.model
@pytest.mark.parametrize(("replicas", "expected"), [(False, "cut into 3 stages"), (True, "whole")])
def test_demo_memory_caps_give_a_three_stage_cut_or_replicas(
    default_model_dir: Path, replicas: bool, expected: str
) -> None:
    # the demo's caps planned as its nodes plan them (three equal CPUs, the demo's format)
    from hetmesh.cli.demo import DEMO_CONTEXT, DEMO_SESSIONS, describe_plan, node_memory
    from hetmesh.node.weights import weight_bytes
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.store import check_model_dir
    from hetmesh.resources import DeviceProfile
    from hetmesh.scheduler import PlanConstraints, plan
    from hetmesh.scheduler.standby import with_standby

    memory = node_memory(default_model_dir, DEMO_WEIGHTS, 1 if replicas else 3)
    config = check_model_dir(default_model_dir)
    name = default_model_dir.name
    devices = [
        DeviceProfile(
            peer_id=f"p{i}",
            device="cpu",
            backend="cpu",
            name="cpu",
            memory_total_bytes=memory,
            memory_free_bytes=memory,
            matmul_flops=5e10,
            memory_bandwidth_bps=1e10,
        )
        for i in range(3)
    ]
    format_bytes = weight_bytes(config, DEMO_WEIGHTS, name=name)
    constraints = PlanConstraints(
        max_context_tokens=DEMO_CONTEXT,
        max_sessions=DEMO_SESSIONS,
        reserve_bytes=64 << 20,
        weights_by_device={f"p{i}/cpu": format_bytes for i in range(3)},
    )
    model = model_profile(config, name=name)
    best = with_standby(
        plan(devices, [], model, constraints=constraints),
        devices,
        [],
        model,
        constraints=constraints,
    )
    text = describe_plan(best, {f"p{i}": f"node{i + 1}" for i in range(3)})
    lines = text.splitlines()
    if replicas:
        assert len(lines) == 3
        assert all(line.startswith("whole model") for line in lines)
    else:
        (line,) = lines
        assert line.startswith(expected)
        assert line.count("->") == 2
