"""The devices file of ``hetmesh plan --devices FILE``: its schema, documented once.

A devices file is JSON: either a list of devices, or ``{"devices": [...], "links":
[...]}``. Each device is a :class:`~hetmesh.resources.DeviceProfile` as the mesh
announces it, plus an optional ``"weights"`` (the format that device would hold
its stages in); each link a :class:`~hetmesh.resources.LinkProfile`. The field
descriptions below are the only copy: ``--help``, ``hetmesh plan --devices-schema``
(a JSON Schema) and the README's table are built from or checked against them, and
a test fails when a record grows a field this module does not describe.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from hetmesh.resources import (
    MAX_BANDWIDTH_BPS,
    MAX_CORES,
    MAX_FLOPS,
    MAX_FREQ_HZ,
    MAX_MEMORY_BYTES,
    MAX_NAME_CHARS,
    MAX_RTT_S,
    DeviceProfile,
    LinkProfile,
)

WEIGHT_FORMATS = ("native", "float32", "bfloat16", "float16", "int8", "int4")


class Field(NamedTuple):
    """One key of a device or link entry, as a person writing the file needs it."""

    json_type: str  # "string", "integer" or "number"
    unit: str
    description: str
    maximum: float | None = None


DEVICE_FIELDS: Mapping[str, Field] = {
    "peer_id": Field("string", "", "Any unique name for the machine (links refer to it)."),
    "device": Field("string", "", 'The torch device: "cpu", "cuda:0", "mps".'),
    "backend": Field("string", "", 'One of "cpu", "cuda", "mps".'),
    "name": Field("string", "", "A readable device name (shown in the plan)."),
    "memory_total_bytes": Field("integer", "bytes", "The device's whole memory.", MAX_MEMORY_BYTES),
    "memory_free_bytes": Field(
        "integer",
        "bytes",
        "Memory the node may use for weights, KV cache and workspace.",
        MAX_MEMORY_BYTES,
    ),
    "matmul_flops": Field(
        "number", "FLOP/s", "Measured dense matmul speed (fp32 on CPU, fp16 on GPU).", MAX_FLOPS
    ),
    "memory_bandwidth_bps": Field(
        "number", "bytes/s", "Measured bandwidth of a large copy.", MAX_BANDWIDTH_BPS
    ),
    "cpu_cores_physical": Field("integer", "cores", "Physical CPU cores (0: unknown).", MAX_CORES),
    "cpu_cores_logical": Field("integer", "cores", "Logical CPU cores (0: unknown).", MAX_CORES),
    "cpu_freq_hz": Field("number", "Hz", "CPU clock (0: unknown).", MAX_FREQ_HZ),
    "utilisation": Field("number", "fraction", "Recent busy share, 0 to 1.", 1.0),
    "compute_capability": Field("string", "", 'CUDA compute capability ("8.0"), or "".'),
    "measured_at_s": Field("number", "s", "When it was measured (Unix time; 0: unknown)."),
    "schema_version": Field("integer", "", "Record version; 1."),
}

LINK_FIELDS: Mapping[str, Field] = {
    "src": Field(
        "string", "", "One end's peer_id (a link serves both directions unless both are given)."
    ),
    "dst": Field("string", "", "The other end's peer_id."),
    "rtt_s": Field("number", "s", "Measured round-trip time.", MAX_RTT_S),
    "bandwidth_bps": Field("number", "bytes/s", "Measured bandwidth.", MAX_BANDWIDTH_BPS),
    "measured_at_s": Field("number", "s", "When it was measured (Unix time; 0: unknown)."),
    "schema_version": Field("integer", "", "Record version; 1."),
}

WEIGHTS_FIELD = Field(
    "string",
    "",
    "Optional: the weight format this device holds its stages in ("
    + ", ".join(WEIGHT_FORMATS)
    + "); default --weights.",
)

HELP = (
    'JSON: a list of devices, or {"devices": [...], "links": [...]}. A device needs '
    "peer_id, device, backend, name, memory_total_bytes, memory_free_bytes, "
    "matmul_flops (FLOP/s), memory_bandwidth_bps (bytes/s); optional: cpu cores, "
    'utilisation, "weights". A link: src, dst, rtt_s, bandwidth_bps (bytes/s). '
    "A pair of machines with no link is planned as 100 Mbit/s with 20 ms of RTT. "
    "Every field, unit and default: "
    "--devices-schema, the README and docs/devices.example.json."
)


def _defaults(record: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _required(record: type) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(record)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def _properties(fields: Mapping[str, Field], defaults: Mapping[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for name, field in fields.items():
        prop: dict[str, Any] = {"type": field.json_type, "description": field.description}
        if field.unit:
            prop["description"] += f" Unit: {field.unit}."
        if field.json_type != "string":
            prop["minimum"] = 0
            if field.maximum is not None:
                prop["maximum"] = field.maximum
        elif name not in ("compute_capability",):
            prop["maxLength"] = MAX_NAME_CHARS
        if name == "backend":
            prop["enum"] = ["cpu", "cuda", "mps"]
        if name in defaults:
            prop["default"] = defaults[name]
        props[name] = prop
    return props


def json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the devices file."""
    device = {
        "type": "object",
        "required": _required(DeviceProfile),
        "properties": {
            **_properties(DEVICE_FIELDS, _defaults(DeviceProfile)),
            "weights": {
                "type": "string",
                "enum": list(WEIGHT_FORMATS),
                "description": WEIGHTS_FIELD.description,
            },
        },
    }
    link = {
        "type": "object",
        "required": _required(LinkProfile),
        "properties": _properties(LINK_FIELDS, _defaults(LinkProfile)),
    }
    devices = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/device"}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "hetmesh plan --devices file",
        "oneOf": [
            {"$ref": "#/$defs/devices"},
            {
                "type": "object",
                "required": ["devices"],
                "properties": {
                    "devices": {"$ref": "#/$defs/devices"},
                    "links": {"type": "array", "items": {"$ref": "#/$defs/link"}},
                },
            },
        ],
        "$defs": {"devices": devices, "device": device, "link": link},
    }


def markdown_table() -> str:
    """The README's table of every key (a test keeps the README's copy equal to it)."""
    rows = ["| entry | key | type | unit | required | meaning |", "|---|---|---|---|---|---|"]
    for entry, record, fields in (
        ("device", DeviceProfile, DEVICE_FIELDS),
        ("link", LinkProfile, LINK_FIELDS),
    ):
        required = set(_required(record))
        defaults = _defaults(record)
        for name, field in fields.items():
            need = "yes" if name in required else f"no ({defaults.get(name)!r})"
            rows.append(
                f"| {entry} | `{name}` | {field.json_type} | {field.unit or '-'} | {need} "
                f"| {field.description} |"
            )
        if entry == "device":
            meaning = WEIGHTS_FIELD.description
            rows.append(f"| device | `weights` | string | - | no (--weights) | {meaning} |")
    return "\n".join(rows)


def parse_entries(data: Any) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """Devices and links of a devices file's JSON; a ValueError names the bad entry and
    field (``devices[2]: DeviceProfile: missing field 'backend'``)."""
    raw_links: Any
    if isinstance(data, list):
        raw_devices, raw_links = data, []
    elif isinstance(data, dict) and isinstance(data.get("devices"), list):
        raw_devices, raw_links = data["devices"], data.get("links") or []
        unknown = sorted(set(data) - {"devices", "links"})
        if unknown:
            raise ValueError(f"unknown top-level keys {unknown}: expected devices and links")
        if not isinstance(raw_links, list):
            raise ValueError("links: expected a list")
    else:
        raise ValueError('expected a list of devices or {"devices": [...], "links": [...]}')
    if not raw_devices:
        raise ValueError("devices: the list is empty")
    devices = [_entry(DeviceProfile, raw, f"devices[{i}]") for i, raw in enumerate(raw_devices)]
    links = [_entry(LinkProfile, raw, f"links[{i}]") for i, raw in enumerate(raw_links)]
    seen: set[str] = set()
    for i, d in enumerate(devices):
        key = f"{d.peer_id}/{d.device}"
        if key in seen:
            raise ValueError(f"devices[{i}]: {key} appears twice")
        seen.add(key)
    peers = {d.peer_id for d in devices}
    for i, link in enumerate(links):
        for end in ("src", "dst"):
            if getattr(link, end) not in peers:
                raise ValueError(f"links[{i}].{end}: no device has peer_id {getattr(link, end)!r}")
    for i, raw in enumerate(raw_devices):
        fmt = raw.get("weights") if isinstance(raw, dict) else None
        if fmt is not None and fmt not in WEIGHT_FORMATS:
            raise ValueError(
                f"devices[{i}].weights: {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}"
            )
    return devices, links


def _entry(record: Any, raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        known = {f.name for f in dataclasses.fields(record)} | (
            {"weights"} if record is DeviceProfile else set()
        )
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}")
    try:
        return record.from_wire(raw)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
