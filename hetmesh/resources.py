"""Shared records: what a device can do, what a link carries, what a model costs.

Discovery fills :class:`DeviceProfile` and :class:`LinkProfile` from
measurements; the scheduler reads them together with a :class:`ModelProfile`
computed from a model's config. Every record is frozen, carries units in its
field names, and converts to and from a plain wire dict (msgpack-able):
``from_wire`` ignores unknown keys, so old and new peers coexist, and raises
``ValueError`` for missing or ill-typed ones (callers at a network boundary
translate that into ``RemoteProtocolError``). What a peer announces may be
anything, so reading is strict on values too: no number on the wire is NaN
or infinite, and the measured figures of a device or a link lie within
physical bounds (:data:`MAX_FLOPS` and its neighbours), so one member's
absurd claim cannot attract the whole model or overflow the planner.

This module imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeVar, get_args, get_origin

PeerId = str
Backend = Literal["cuda", "mps", "cpu"]
UnitKind = Literal["embed", "block", "head"]

_R = TypeVar("_R", bound="WireRecord")

# Physical bounds on what a device or link may claim: well above any machine
# that exists (a whole GPU pod does ~1e18 FLOP/s), far below what breaks the planner.
MAX_FLOPS = 1e18
MAX_BANDWIDTH_BPS = 1e14  # bytes/s: 100 TB/s
MAX_MEMORY_BYTES = 2**50  # 1 PiB
MAX_CORES = 2**16
MAX_FREQ_HZ = 1e11
MAX_RTT_S = 3600.0
MAX_NAME_CHARS = 256  # peer ids, device names, compute capabilities


def _check(value: Any, hint: Any, where: str) -> Any:
    """Validate ``value`` against a type hint and return it in canonical form."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in get_args(hint):
            raise ValueError(f"{where}: {value!r} is not one of {get_args(hint)}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in get_args(hint):
            return None
        errors = []
        for arm in get_args(hint):
            if arm is type(None):
                continue
            try:
                return _check(value, arm, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors) or f"{where}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(hint)[:1]
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
        key_hint, value_hint = get_args(hint)
        return {
            _check(k, key_hint, where): _check(v, value_hint, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if isinstance(hint, type) and issubclass(hint, WireRecord):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
        return hint.from_wire(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: expected a number, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError as exc:  # an integer beyond any float
            raise ValueError(f"{where}: {value!r} is out of range") from exc
        if not math.isfinite(number):
            raise ValueError(f"{where}: {number} is not a finite number")
        return number
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if hint in (str, bool, bytes):
        if not isinstance(value, hint):
            raise ValueError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # a bug in a record


def _to_plain(value: Any) -> Any:
    if isinstance(value, WireRecord):
        return value.to_wire()
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    # resolving the annotations costs ~2 ms a record; every member decodes every
    # record version it pulls, so resolve them once per class
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


class WireRecord:
    """Mixin for frozen dataclasses that travel as plain dicts."""

    def to_wire(self) -> dict[str, Any]:
        return {
            f.name: _to_plain(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
        hints = _type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                has_default = (
                    f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING
                )
                if has_default:
                    continue
                raise ValueError(f"{cls.__name__}: missing field {f.name!r}")
            kwargs[f.name] = _check(data[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cls.__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile(WireRecord):
    """One compute device of a peer, with measured (not nominal) speeds."""

    peer_id: PeerId
    device: str  # torch device string: "cpu", "cuda:0", "mps"
    backend: Backend
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    matmul_flops: float  # measured dense fp32 (cpu) / fp16 (gpu) matmul FLOP/s
    memory_bandwidth_bps: float  # measured bytes/s for a large copy
    cpu_cores_physical: int = 0
    cpu_cores_logical: int = 0
    cpu_freq_hz: float = 0.0
    utilisation: float = 0.0  # 0..1 recent busy fraction
    compute_capability: str = ""
    measured_at_s: float = 0.0
    schema_version: int = 1

    def __post_init__(self) -> None:
        _within("memory_total_bytes", self.memory_total_bytes, MAX_MEMORY_BYTES)
        _within("memory_free_bytes", self.memory_free_bytes, MAX_MEMORY_BYTES)
        _within("matmul_flops", self.matmul_flops, MAX_FLOPS)
        _within("memory_bandwidth_bps", self.memory_bandwidth_bps, MAX_BANDWIDTH_BPS)
        _within("cpu_cores_physical", self.cpu_cores_physical, MAX_CORES)
        _within("cpu_cores_logical", self.cpu_cores_logical, MAX_CORES)
        _within("cpu_freq_hz", self.cpu_freq_hz, MAX_FREQ_HZ)
        _within("utilisation", self.utilisation, 1.0)
        _within("measured_at_s", self.measured_at_s, math.inf)
        for name in ("peer_id", "device", "name", "compute_capability"):
            if len(getattr(self, name)) > MAX_NAME_CHARS:
                raise ValueError(f"{name} is longer than {MAX_NAME_CHARS} characters")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkProfile(WireRecord):
    """A directed edge between two peers, as measured over the data plane."""

    src: PeerId
    dst: PeerId
    rtt_s: float
    bandwidth_bps: float  # bytes per second
    measured_at_s: float = 0.0
    schema_version: int = 1

    def __post_init__(self) -> None:
        _within("rtt_s", self.rtt_s, MAX_RTT_S)
        _within("bandwidth_bps", self.bandwidth_bps, MAX_BANDWIDTH_BPS)
        _within("measured_at_s", self.measured_at_s, math.inf)
        if max(len(self.src), len(self.dst)) > MAX_NAME_CHARS:
            raise ValueError(f"src or dst is longer than {MAX_NAME_CHARS} characters")


def _within(name: str, value: float, limit: float) -> None:
    """Refuse a figure that is NaN, negative or above ``limit``."""
    if not 0 <= value <= limit:  # NaN fails both comparisons
        raise ValueError(f"{name} = {value!r} is outside [0, {limit}]")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitProfile(WireRecord):
    """The cost of one unit of a model: the embedding, one decoder layer, or the head.

    Per-token FLOPs split into a part independent of the context length
    (``flops_per_token``: the matmuls against weights) and a part that grows with
    it (``attention_flops_per_token_per_context``), so a decode step at context
    length ``L`` costs ``flops_per_token + L * attention_flops_per_token_per_context``.
    """

    kind: UnitKind
    index: int  # position in ModelProfile.units
    param_count: int  # parameters a stage holding this unit must load
    param_bytes: int
    flops_per_token: float
    attention_flops_per_token_per_context: float
    kv_bytes_per_token: int
    input_bytes_per_token: int  # what crosses the boundary into this unit
    output_bytes_per_token: int  # what crosses the boundary out of this unit

    def decode_flops(self, context_len: int) -> float:
        """FLOPs of one decode step with ``context_len`` tokens already cached."""
        return self.flops_per_token + context_len * self.attention_flops_per_token_per_context

    def prefill_flops(self, n_tokens: int, start: int = 0) -> float:
        """FLOPs of a prefill chunk of ``n_tokens`` after ``start`` cached tokens."""
        # token t attends to start + t + 1 positions; sum over the chunk
        attended = n_tokens * start + n_tokens * (n_tokens + 1) / 2
        return (
            n_tokens * self.flops_per_token + attended * self.attention_flops_per_token_per_context
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile(WireRecord):
    """A model cut into units, computed from its config alone (no weights)."""

    name: str
    architecture: str
    dtype: str  # "float32", "bfloat16", "float16"
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_context: int
    tie_word_embeddings: bool
    units: tuple[UnitProfile, ...]
    schema_version: int = 1

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def tied_param_count(self) -> int:
        """Parameters shared by the embedding and the head when tied, else 0."""
        return self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0

    def range_param_count(self, start: int, end: int) -> int:
        """Parameters a single stage holding ``units[start:end)`` loads.

        With tied embeddings a stage holding both the embedding and the head
        loads the shared matrix once.
        """
        self._check_range(start, end)
        total = sum(u.param_count for u in self.units[start:end])
        if start == 0 and end == self.num_units:
            total -= self.tied_param_count
        return total

    def range_param_bytes(self, start: int, end: int) -> int:
        self._check_range(start, end)
        total = sum(u.param_bytes for u in self.units[start:end])
        if start == 0 and end == self.num_units and self.units:
            per_param = self.units[0].param_bytes / max(self.units[0].param_count, 1)
            total -= int(self.tied_param_count * per_param)
        return total

    @property
    def total_param_count(self) -> int:
        return self.range_param_count(0, self.num_units)

    @property
    def total_param_bytes(self) -> int:
        return self.range_param_bytes(0, self.num_units)

    def range_kv_bytes_per_token(self, start: int, end: int) -> int:
        self._check_range(start, end)
        return sum(u.kv_bytes_per_token for u in self.units[start:end])

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_units:
            raise ValueError(f"unit range [{start}, {end}) outside [0, {self.num_units})")


__all__ = [
    "MAX_BANDWIDTH_BPS",
    "MAX_FLOPS",
    "MAX_MEMORY_BYTES",
    "Backend",
    "DeviceProfile",
    "LinkProfile",
    "ModelProfile",
    "PeerId",
    "UnitKind",
    "UnitProfile",
    "WireRecord",
]
