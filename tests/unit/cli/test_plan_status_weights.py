"""``hetmesh plan`` and ``hetmesh status`` show each stage's and peer's weight format."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hetmesh.cli import app
from hetmesh.cli.status import render_status
from hetmesh.cli.status_view import summarize
from hetmesh.resources import DeviceProfile

GIB = 1024**3


def _cpu(peer: str, memory: int) -> DeviceProfile:
    return DeviceProfile(
        peer_id=peer,
        device="cpu",
        backend="cpu",
        name=peer,
        memory_total_bytes=memory,
        memory_free_bytes=memory,
        matmul_flops=2e11,
        memory_bandwidth_bps=2e10,
    )


def _plan_json(tmp_path: Path, entries: list[dict], *args: str) -> dict:
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"devices": entries}))
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "llama-7b",
            "--devices",
            str(path),
            "--max-context",
            "512",
            "--json",
            *args,
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_fits_llama_7b_only_when_the_devices_hold_int8(tmp_path: Path) -> None:
    # three 6 GiB CPUs: 7B in fp32 (27 GB) does not fit, in int8 (~7 GB) it does
    devices = [_cpu(p, 6 * GIB).to_wire() for p in ("a", "b", "c")]
    result = CliRunner().invoke(
        app, ["plan", "--model", "llama-7b", "--devices", str(_write(tmp_path, devices))]
    )
    assert result.exit_code != 0
    assert "does not fit" in str(result.exception)
    out = _plan_json(tmp_path, devices, "--weights", "int8")
    stages = [s for p in out["plan"]["pipelines"] for s in p["stages"]]
    assert {s["weights"] for s in stages} == {"int8"}
    assert all(s["memory_bytes"] <= 6 * GIB for s in stages)


def test_plan_takes_each_devices_own_format_and_shows_it(tmp_path: Path) -> None:
    # neither holds 7B alone (13.5 GB in bf16, 3.9 GB in int4): both serve
    devices = [
        {**_cpu("a", 8 * GIB).to_wire(), "weights": "bfloat16"},
        {**_cpu("b", 3 * GIB).to_wire(), "weights": "int4"},
    ]
    out = _plan_json(tmp_path, devices)
    by_peer = {s["peer_id"]: s["weights"] for p in out["plan"]["pipelines"] for s in p["stages"]}
    assert by_peer == {"a": "bfloat16", "b": "int4"}
    path = _write(tmp_path, devices)
    result = CliRunner().invoke(
        app,
        ["plan", "--model", "llama-7b", "--devices", str(path), "--max-context", "512"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.exception
    text = result.output
    assert "weights" in text
    assert "bfloat16" in text
    assert "int4" in text


def test_plan_holds_a_model_folder_in_its_own_format_as_the_nodes_do(
    tmp_path: Path, default_model_dir: Path
) -> None:
    # the default model ships Q4_1: a node without --weights holds it as int4, so
    # the plan charges int4 bytes; fp32 (0.6 GB) would not fit these 0.5 GiB CPUs
    devices = [_cpu(p, GIB // 2).to_wire() for p in ("a", "b")]
    path = _write(tmp_path, devices)
    args = ["plan", "--model", str(default_model_dir), "--devices", str(path), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stages = [s for p in json.loads(result.output)["plan"]["pipelines"] for s in p["stages"]]
    assert {s["weights"] for s in stages} == {"int4"}
    assert CliRunner().invoke(app, [*args, "--weights", "native"]).output == result.output
    fp32 = CliRunner().invoke(app, [*args, "--weights", "float32"])
    assert fp32.exit_code != 0
    assert "does not fit" in str(fp32.exception)
    # a known shape stores no weights: native names no format there
    shape = CliRunner().invoke(
        app, ["plan", "--model", "llama-7b", "--devices", str(path), "--weights", "native"]
    )
    assert shape.exit_code == 2
    assert "native" in shape.output


def _write(tmp_path: Path, devices: list[dict]) -> Path:
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(devices))
    return path


def test_status_shows_the_format_of_every_peer_and_stage() -> None:
    stage = {
        "peer_id": "A",
        "device": "cpu",
        "start": 0,
        "end": 32,
        "decode_step_s": 0.01,
        "batch_step_s": 0.01,
        "prefill_s_per_1k": 1.0,
        "link_out_s": 0.0,
        "memory_bytes": 1,
        "weights": "int8",
    }
    plan = {
        "epoch": 1,
        "model_name": "m",
        "objective": "latency",
        "strategy": "exact",
        "pipelines": [
            {
                "stages": [stage],
                "decode_latency_s": 0.01,
                "prefill_s_per_1k": 1.0,
                "bottleneck_s": 0.01,
                "throughput_tps": 100.0,
            }
        ],
        "objective_value": 0.01,
        "decode_latency_s": 0.01,
        "prefill_s_per_1k": 1.0,
        "throughput_tps": 100.0,
    }
    view = {
        "self": "A",
        "peers": [
            {
                "peer_id": "A",
                "health": "self",
                "record": {"peer_id": "A", "extra": {"plan": plan, "weights": "int8"}},
            },
            {"peer_id": "B", "health": "alive", "record": {"peer_id": "B", "extra": {}}},
        ],
        "links": [],
    }
    summary = summarize(view)
    assert summary["plan"]["pipelines"][0]["stages"][0]["weights"] == "int8"
    assert {p["peer_id"]: p["weights"] for p in summary["load"]["peers"]} == {"A": "int8", "B": "-"}
    text = render_status(view, width=220)
    assert "weights" in text
    assert "int8" in text


def test_plan_from_a_live_mesh_takes_each_peers_announced_format(monkeypatch) -> None:
    import hetmesh.cli.plan as plan_cli

    devices = [_cpu("a", 8 * GIB), _cpu("b", 3 * GIB)]
    announced = {"a": "bfloat16", "b": "int4"}
    view = {
        "peers": [
            {
                "peer_id": d.peer_id,
                "health": "alive",
                "record": {"devices": [d.to_wire()], "extra": {"weights": announced[d.peer_id]}},
            }
            for d in devices
        ],
        "links": [],
    }
    monkeypatch.setattr(plan_cli, "_fetch_view", lambda *_args: view)
    result = CliRunner().invoke(
        app,
        [
            *("plan", "--model", "llama-7b", "--mesh", "/ip4/127.0.0.1/tcp/1/p2p/Qm"),
            *("--json", "--max-context", "512"),
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    by_peer = {s["peer_id"]: s["weights"] for p in out["plan"]["pipelines"] for s in p["stages"]}
    assert by_peer == announced
