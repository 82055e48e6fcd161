"""``hetmesh plan``: devices file in, stage map and baseline comparison out."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetmesh.cli import app
from hetmesh.cli.plan import devices_from_view, load_model, parse_devices, render_plan
from hetmesh.errors import ModelNotFound
from hetmesh.partition.profile import KNOWN_SHAPES
from hetmesh.scheduler import BASELINES, plan
from hetmesh.scheduler.synthetic import random_mesh


@pytest.fixture
def mesh_file(tmp_path: Path) -> Path:
    devs, links = random_mesh(random.Random(4), 4, classes=("consumer-gpu", "datacenter-gpu"))
    path = tmp_path / "mesh.json"
    path.write_text(
        json.dumps({"devices": [d.to_wire() for d in devs], "links": [x.to_wire() for x in links]})
    )
    return path


def test_plan_command_prints_stage_map_and_baselines(mesh_file: Path) -> None:
    result = CliRunner().invoke(
        app, ["plan", "--model", "llama-13b", "--devices", str(mesh_file)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "pipeline 0" in result.output
    for name in ("planner (exact)", "even", "memory-proportional", "greedy", "planner gain"):
        assert name in result.output


def test_plan_command_json_throughput(mesh_file: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "llama-7b",
            "--devices",
            str(mesh_file),
            "--objective",
            "throughput",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["plan"]["objective"] == "throughput"
    assert set(out["baselines"]) == set(BASELINES)
    best = out["plan"]["throughput_tps"]
    for other in out["baselines"].values():
        if "error" not in other:
            assert best >= other["throughput_tps"] * (1 - 1e-9)


def test_plan_command_rejects_bad_inputs(mesh_file: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(
        app, ["plan", "--model", "llama-7b", "--devices", str(mesh_file), "--mesh", "/ip4/x"]
    )
    assert both.exit_code != 0
    assert "exactly one" in both.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"peer_id": "a"}]))
    result = runner.invoke(app, ["plan", "--model", "llama-7b", "--devices", str(bad)])
    assert result.exit_code != 0
    assert "missing field" in result.output
    wrong = runner.invoke(
        app, ["plan", "--model", "llama-7b", "--devices", str(mesh_file), "--objective", "speed"]
    )
    assert wrong.exit_code != 0


def test_load_model_by_name_folder_or_error(tmp_path: Path) -> None:
    assert load_model("llama-7b", "float16").num_layers == 32
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_SHAPES["smollm2-135m"]))
    assert load_model(str(tmp_path), "float32").num_layers == 30
    with pytest.raises(ModelNotFound):
        load_model(str(tmp_path / "nowhere"), "float32")


def test_devices_from_view_keeps_live_peers_only() -> None:
    devs, links = random_mesh(random.Random(1), 3)
    view = {
        "peers": [
            {
                "peer_id": devs[0].peer_id,
                "health": "self",
                "record": {"devices": [devs[0].to_wire()]},
            },
            {
                "peer_id": devs[1].peer_id,
                "health": "alive",
                "record": {"devices": [devs[1].to_wire()]},
            },
            {
                "peer_id": devs[2].peer_id,
                "health": "dead",
                "record": {"devices": [devs[2].to_wire()]},
            },
        ],
        "links": [x.to_wire() for x in links],
    }
    found, kept = devices_from_view(view)
    assert found == devs[:2]
    assert kept
    assert all(devs[2].peer_id not in (x.src, x.dst) for x in kept)


def test_parse_devices_accepts_a_bare_list_and_render_is_pure() -> None:
    devs, _ = random_mesh(random.Random(2), 2, classes=("datacenter-gpu",))
    found, links = parse_devices([d.to_wire() for d in devs])
    assert found == devs
    assert links == []
    m = load_model("llama-7b", "float16")
    chosen = plan(found, links, m)
    text = render_plan(chosen, {"even": "does not fit (1.00 GiB short)"}, m)
    assert "does not fit" in text
    assert "embed" in text
    assert "head" in text


def test_plan_command_from_a_mesh_status_view(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetmesh.cli.plan as plan_cli

    devs, links = random_mesh(random.Random(6), 3, classes=("datacenter-gpu",))
    view = {
        "peers": [
            {"peer_id": d.peer_id, "health": "alive", "record": {"devices": [d.to_wire()]}}
            for d in devs
        ],
        "links": [x.to_wire() for x in links],
    }
    asked: list[str] = []

    def fake_fetch(mesh: str, secret: str | None, timeout: float) -> dict[str, object]:
        asked.append(mesh)
        return view

    monkeypatch.setattr(plan_cli, "_fetch_view", fake_fetch)
    addr = "/ip4/127.0.0.1/tcp/4001/p2p/QmPeer"
    result = CliRunner().invoke(app, ["plan", "--model", "llama-7b", "--mesh", addr, "--json"])
    assert result.exit_code == 0, result.output
    assert asked == [addr]
    used = {
        s["peer_id"] for p in json.loads(result.output)["plan"]["pipelines"] for s in p["stages"]
    }
    assert used <= {d.peer_id for d in devs}
