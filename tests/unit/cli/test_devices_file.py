"""The devices file of ``hetmesh plan``: documented once, examples that plan, errors
that name the field."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hetmesh.cli import app
from hetmesh.cli.devices_file import (
    DEVICE_FIELDS,
    LINK_FIELDS,
    json_schema,
    markdown_table,
    parse_entries,
)
from hetmesh.resources import DeviceProfile, LinkProfile

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "devices.example.json"


def test_every_record_field_is_documented() -> None:
    assert set(DEVICE_FIELDS) == {f.name for f in dataclasses.fields(DeviceProfile)}
    assert set(LINK_FIELDS) == {f.name for f in dataclasses.fields(LinkProfile)}


def test_schema_requires_what_the_records_require() -> None:
    defs = json_schema()["$defs"]
    for name, record in (("device", DeviceProfile), ("link", LinkProfile)):
        required = [
            f.name
            for f in dataclasses.fields(record)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        assert defs[name]["required"] == required
        for field in dataclasses.fields(record):
            prop = defs[name]["properties"][field.name]
            if field.default is not dataclasses.MISSING:
                assert prop["default"] == field.default


def test_readme_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- devices-file-table")
    body = readme[readme.index("\n", start) + 1 : readme.index("<!-- /devices-file-table -->")]
    assert body.strip() == markdown_table().strip()


def test_example_file_plans(tmp_path: Path) -> None:
    data = json.loads(EXAMPLE.read_text())
    devices, links = parse_entries(data)
    assert {d.peer_id for d in devices} == {"desktop", "laptop", "mini-pc"}
    assert len(links) == 3
    result = CliRunner().invoke(
        app,
        ["plan", "--model", "llama-13b", "--devices", str(EXAMPLE), "--json"],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["plan"]
    peers = {st["peer_id"] for pipe in plan["pipelines"] for st in pipe["stages"]}
    assert peers <= {"desktop", "laptop", "mini-pc"}
    assert len(peers) >= 2  # 13B in fp16 fits no single machine of the example


def test_devices_schema_flag_needs_no_model() -> None:
    result = CliRunner().invoke(app, ["plan", "--devices-schema"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == json_schema()


def _example() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return data


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["devices"][1].pop("backend"), "devices[1]: DeviceProfile: missing field"),
        (
            lambda d: d["devices"][2].__setitem__("memory_free_bytes", "6GiB"),
            "devices[2]: DeviceProfile.memory_free_bytes: expected an integer",
        ),
        (
            lambda d: d["devices"][0].__setitem__("memory_free_byte", 1),
            "devices[0]: unknown keys ['memory_free_byte']",
        ),
        (
            lambda d: d["devices"][0].__setitem__("matmul_flops", -1.0),
            "devices[0]: DeviceProfile: matmul_flops = -1.0 is outside",
        ),
        (
            lambda d: d["devices"][0].__setitem__("weights", "q4"),
            "devices[0].weights: 'q4' is not one of",
        ),
        (lambda d: d["links"][2].__setitem__("dst", "tablet"), "links[2].dst: no device"),
        (lambda d: d["links"][0].pop("rtt_s"), "links[0]: LinkProfile: missing field 'rtt_s'"),
        (lambda d: d.__setitem__("link", []), "unknown top-level keys ['link']"),
        (lambda d: d["devices"].append(dict(d["devices"][0])), "desktop/cuda:0 appears twice"),
        (lambda d: d["devices"].clear(), "devices: the list is empty"),
    ],
)
def test_malformed_files_name_the_field(mutate: Any, expected: str, tmp_path: Path) -> None:
    data = _example()
    mutate(data)
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_entries(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(
        app, ["plan", "--model", "llama-7b", "--devices", str(path)], env={"COLUMNS": "300"}
    )
    assert result.exit_code != 0
    assert "devices" in result.output or "links" in result.output
