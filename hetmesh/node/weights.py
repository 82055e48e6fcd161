"""A node's weight format: checked at start-up, chosen by measurement, announced, planned.

Every node serves its stages in one weight format (``--weights``). It checks
at start-up that its device has kernels for it (a one-line error otherwise),
announces it (``extra["weights"]``), and the coordinator charges each device
the bytes of its own format (:func:`weights_constraints`): a mesh may mix a
bf16 GPU with an int8 CPU, and the plan says which stage holds which.

``auto`` is decided by the node's calibration (:func:`choose_weights`): it
times a decoder block in each format the device runs and keeps the fastest
float format that fits; int8 and int4 win only if they measured faster, or
when no float format fits at all (on a CPU their weight-only kernels are
slower than fp32, see ``docs/weights.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hetmesh.errors import InvalidRequest
from hetmesh.resources import DeviceProfile, ModelProfile
from hetmesh.scheduler.cost import CostModel
from hetmesh.scheduler.records import PlanConstraints, WeightBytes, device_key

WEIGHTS_KEY = "weights"
# float formats by preference when they measure alike; compact ones by fidelity
FLOAT_ORDER: tuple[str, ...] = ("float32", "bfloat16", "float16")
QUANTIZED_ORDER: tuple[str, ...] = ("int8", "int4")


def check_weights(setting: str, device: str) -> str | None:
    """The format named by ``setting`` (``None`` for auto), checked against ``device``;
    ``"native"`` as it is (the model folder settles it).

    Raises ``InvalidRequest`` (one line) for an unknown name or a format the
    device has no kernel for: the CLI reports it before the node joins.
    """
    from hetmesh.partition.formats import NATIVE, check_supported, is_native, parse_weights

    if is_native(setting):
        return NATIVE  # read off the model folder once the node has it (Serving)
    fmt = parse_weights(setting)
    if fmt is None:
        return None
    try:
        check_supported(fmt, device)
    except InvalidRequest as exc:
        raise InvalidRequest(f"--weights {fmt.value} on {device}: {exc}") from None
    return fmt.value


def supported_formats(device: str) -> list[str]:
    """The formats ``device`` has kernels for, in :data:`FLOAT_ORDER` then compact order."""
    from hetmesh.partition.formats import WeightFormat, check_supported

    out = []
    for name in (*FLOAT_ORDER, *QUANTIZED_ORDER):
        if name == "float16" and not device.startswith("cuda"):
            continue  # fp16 matmuls on a CPU are emulated: never the fastest there
        try:
            check_supported(WeightFormat(name), device)
        except InvalidRequest:
            continue
        out.append(name)
    return out


def weight_bytes(config: Mapping[str, Any], weights: str, *, name: str) -> WeightBytes:
    """What ``weights`` costs per unit for the model of ``config`` (the planner's input)."""
    from hetmesh.partition.formats import QUANTIZED_FORMATS
    from hetmesh.partition.profile import model_profile
    from hetmesh.partition.quant import packed_head_bytes

    profile = model_profile(config, weights=weights, name=name)
    quantized = weights in {f.value for f in QUANTIZED_FORMATS}
    # an int head's packed copy (charged on every CPU; made where its sums are exact)
    pack = packed_head_bytes(profile.vocab_size, profile.hidden_size) if quantized else 0
    return dataclasses.replace(WeightBytes.of(profile, weights=weights), head_pack_bytes=pack)


def fits(
    profile: ModelProfile, weights: WeightBytes, device: DeviceProfile, constraints: PlanConstraints
) -> bool:
    """Whether ``device`` can hold at least one unit of the model in this format."""
    key = device_key(device.peer_id, device.device)
    cons = dataclasses.replace(constraints, weights_by_device={key: weights})
    return CostModel(profile, [device], [], cons).holds_any_unit(0)


def choose_weights(
    candidates: Sequence[str],
    fitting: Callable[[str], bool],
    measure: Callable[[str], float | None],
) -> tuple[str, float | None]:
    """``auto``: the format to serve in, with its measured block step (None: not measured).

    ``candidates``: the formats the device runs; ``fitting(f)``: whether the
    device holds a unit in ``f``; ``measure(f)``: one block's decode step in
    ``f`` (None if it could not be timed). The fastest fitting float format
    wins; int8 or int4 only where it measured faster than that, or where no
    float format fits (then the fastest compact one that fits, the most faithful
    on equal or unmeasured steps): never a format slower than another that fits.
    """
    floats = [f for f in candidates if f in FLOAT_ORDER and fitting(f)]
    compact = [f for f in candidates if f in QUANTIZED_ORDER and fitting(f)]
    timed: dict[str, float] = {}
    for f in floats:
        step = measure(f)
        if step is not None:
            timed[f] = step
    if floats:
        best = min(timed, key=lambda f: (timed[f], FLOAT_ORDER.index(f)), default=floats[0])
        if best in timed:
            quick = {f: step for f in compact if (step := measure(f)) is not None}
            fastest = min(quick, key=lambda f: (quick[f], QUANTIZED_ORDER.index(f)), default=None)
            if fastest is not None and quick[fastest] < timed[best]:
                return fastest, quick[fastest]
        return best, timed.get(best)
    if compact:  # no float fits: the fastest compact format that does (the most faithful on ties)
        steps = {f: step for f in compact if (step := measure(f)) is not None}
        pick = min(steps, key=lambda f: (steps[f], QUANTIZED_ORDER.index(f)), default=compact[0])
        return pick, steps.get(pick)
    # nothing fits here alone: serve the most compact format, the mesh may still pool it
    last = next((f for f in reversed((*FLOAT_ORDER, *QUANTIZED_ORDER)) if f in candidates), None)
    if last is None:
        raise InvalidRequest("this device runs no weight format")
    return last, measure(last)


def weights_constraints(
    constraints: PlanConstraints,
    announced: Iterable[tuple[str, Mapping[str, Any]]],
    devices: Sequence[DeviceProfile],
    bytes_of: Callable[[str], WeightBytes | None],
) -> PlanConstraints:
    """``constraints`` with every device charged the bytes of its peer's announced format.

    ``announced``: (peer id, that peer's announcement ``extra``); ``bytes_of``
    maps a format name to its bytes (None: unknown, the model profile's then).
    """
    from hetmesh.scheduler.announcement import read_serving

    formats: dict[str, str] = {}
    for peer_id, extra in announced:
        value = read_serving(extra, plan_of=None).weights
        if value:
            formats[peer_id] = value
    by_device: dict[str, WeightBytes] = {}
    for d in devices:
        name = formats.get(d.peer_id)
        found = bytes_of(name) if name is not None else None
        if found is not None:
            by_device[device_key(d.peer_id, d.device)] = found
    if by_device == constraints.weights_by_device:
        return constraints
    return dataclasses.replace(constraints, weights_by_device=by_device)


__all__ = [
    "FLOAT_ORDER",
    "QUANTIZED_ORDER",
    "WEIGHTS_KEY",
    "check_weights",
    "choose_weights",
    "fits",
    "supported_formats",
    "weight_bytes",
    "weights_constraints",
]
