"""Data-plane frames and their sans-IO codec (h11's shape).

Wire layout of one frame::

    prefix  16 bytes  ">2sBBIQ": magic b"HM", protocol version, tag,
                      header length (u32), payload length (u64)
    header  msgpack list, the frame's fields; tensors as [dtype, shape, nbytes]
    payload the raw bytes of every tensor, in order, nothing between them

:func:`encode` returns the prefix+header as ``bytes`` followed by one
``memoryview`` per tensor, read straight from the tensor's memory, for a
gathering write. :class:`Decoder` is incremental (``receive_data`` /
``next_frame``); every length is checked against :class:`Limits` before
anything is allocated. Peer faults raise :class:`RemoteProtocolError`, our
own misuse :class:`LocalProtocolError`.

Every reader checks a frame head in the same two steps, here and nowhere
else: :func:`parse_prefix` (magic, version, tag, lengths against
:class:`Limits`) and :func:`parse_header` (the fields, per :data:`SCHEMAS`);
:func:`parse_head` does both for a head that arrives whole in one packet.
The stream :class:`Decoder`, the blocking socket reader (which then
``recv_into`` tensors directly) and the shm doorbell all use them, then
:meth:`Pending.build` once the payload is in.

Imports neither trio nor libp2p.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Final, NamedTuple

import msgpack
import torch

from hetmesh.error_codec import error_code
from hetmesh.errors import (
    AuthenticationFailed,
    LocalProtocolError,
    PeerUnreachable,
    RemoteProtocolError,
)
from hetmesh.transport.codec import (
    DTYPES,
    TensorSpec,
    as_tensor,
    byte_view,
    checked_spec,
    host_tensor,
    same_bits,
)

MAGIC: Final = b"HM"
VERSION: Final = 1
PREFIX = struct.Struct(">2sBBIQ")
PREFIX_BYTES: Final = PREFIX.size


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Caps checked before any allocation. Both peers should use the same ones."""

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 4 << 30
    max_tensors: int = 64
    max_dims: int = 8
    max_elements: int = 1 << 31
    max_items: int = 1 << 20  # positions, token ids
    max_string_bytes: int = 64 << 10
    # the header of a frame that carries neither tensors nor token ids (Offer, Hello,
    # Cancel, Error, ...): a few strings, never near max_header_bytes
    max_control_header_bytes: int = 128 << 10
    # what one frame of these kinds may carry (None: max_payload_bytes); a node that
    # serves a model sets them from its shape (limits_for_model): checked on the
    # prefix, before the header is read or a buffer allocated
    max_activation_bytes: int | None = None
    max_kv_block_bytes: int | None = None
    # session id -> the most payload bytes a KVBlock of that session may carry here
    # (None: no KV of it is expected here); asked with the KVBlock's header, before
    # its payload is allocated (a stage server's sessions awaiting KV: issue 45). It
    # may be called from a link's reader thread.
    kv_block_bytes: Callable[[str], int | None] | None = None


DEFAULT_LIMITS: Final = Limits()
# draft tokens one verify step may carry (Activations.drafts; speculative decoding)
MAX_DRAFTS: Final = 32

# headroom over what a frame of a model's shape needs (a float32 stage of a bf16
# model, a few positions more): generous, still far under max_payload_bytes
_MODEL_HEADROOM: Final = 2


def limits_for_profile(profile: Any, base: Limits = DEFAULT_LIMITS) -> Limits:
    """:func:`limits_for_model` for a :class:`~hetmesh.resources.ModelProfile` (whose KV
    figures are in its activation dtype, float32 unless the format is narrower)."""
    return limits_for_model(
        hidden_size=profile.hidden_size,
        max_context=profile.max_context,
        kv_bytes_per_token=profile.range_kv_bytes_per_token(0, profile.num_units),
        base=base,
    )


def limits_for_model(
    *,
    hidden_size: int,
    max_context: int,
    kv_bytes_per_token: int,
    activation_itemsize: int = 4,
    base: Limits = DEFAULT_LIMITS,
) -> Limits:
    """``base`` with payload caps for frames of one model: an Activations frame holds at
    most ``max_context`` positions of ``hidden_size`` values (or token ids), a KVBlock
    at most ``max_context`` tokens of the whole model's KV (``kv_bytes_per_token``, in
    the stage's own dtype or narrower)."""
    activation = max_context * max(hidden_size * activation_itemsize, 8)
    kv = max_context * kv_bytes_per_token
    return dataclasses.replace(
        base,
        max_activation_bytes=min(base.max_payload_bytes, _MODEL_HEADROOM * activation),
        max_kv_block_bytes=min(base.max_payload_bytes, _MODEL_HEADROOM * kv),
    )


class Frame:
    """Base of every frame. ``TAG`` is stable and never reused."""

    TAG: ClassVar[int]
    __slots__ = ()

    def tensors_(self) -> tuple[torch.Tensor, ...]:
        return ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in fields(self):  # type: ignore[arg-type]
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "tensors":
                if len(a) != len(b) or not all(same_bits(x, y) for x, y in zip(a, b, strict=True)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Offer(Frame):
    """One peer's data-plane offer, exchanged on the control stream.

    ``endpoints`` maps a backend to where to reach it (``"host:port"`` for
    tcp/torchdist, an abstract unix socket name for shm). The listener also
    puts the one-time credential in its offer; the dialer leaves it empty.
    """

    TAG: ClassVar[int] = 1
    peer_id: str
    host_id: str
    backends: tuple[str, ...]
    endpoints: tuple[tuple[str, str], ...] = ()
    cuda: bool = False
    nccl: bool = False
    gloo: bool = False
    deny: tuple[str, ...] = ()
    require_encryption: bool = False
    credential_id: bytes = b""
    credential_secret: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Decision(Frame):
    """The dialer tells the listener which backend it actually connected."""

    TAG: ClassVar[int] = 2
    backend: str
    reason: str
    encrypted: bool = False  # tcp: frames travel sealed (AES-GCM) with the link's keys


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Hello(Frame):
    """First frame on a data connection: who dials, for which credential."""

    TAG: ClassVar[int] = 3
    peer_id: str
    credential_id: bytes
    nonce: bytes


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Challenge(Frame):
    TAG: ClassVar[int] = 4
    nonce: bytes


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Proof(Frame):
    TAG: ClassVar[int] = 5
    mac: bytes


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Activations(Frame):
    """Hidden states (or token ids) for one step of one session.

    ``drafts``: a verify step's draft tokens (speculative decoding, issue 48), the
    inputs at ``positions[1:]``, passed on by every stage so the head stage can
    compare them with its own draws; empty for a plain step (whose wire header is
    then the one it always was). At most :data:`MAX_DRAFTS`."""

    TAG: ClassVar[int] = 6
    session_id: str
    step: int
    positions: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    drafts: tuple[int, ...] = ()

    def tensors_(self) -> tuple[torch.Tensor, ...]:
        return self.tensors


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Tokens(Frame):
    """Sampled token ids of one step of one session; ``position``: the sequence position
    (prompt and generated tokens before it) of the first, so a gateway can tell a token
    it already delivered from the next one."""

    TAG: ClassVar[int] = 7
    session_id: str
    step: int
    token_ids: tuple[int, ...]
    position: int = 0
    logprobs: bytes = b""  # packed by hetmesh.protocol.logprobs when a request asks


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class KVBlock(Frame):
    """KV cache of ``session_id`` for layers from ``first_layer``, positions from ``start``."""

    TAG: ClassVar[int] = 8
    session_id: str
    first_layer: int
    start: int
    tensors: tuple[torch.Tensor, ...]

    def tensors_(self) -> tuple[torch.Tensor, ...]:
        return self.tensors


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Cancel(Frame):
    TAG: ClassVar[int] = 9
    session_id: str
    reason: str = ""


# Error.code is the error's wire code (hetmesh.errors.error_code); the data plane's own:
ERROR_AUTH: Final = error_code(AuthenticationFailed)  # a credential was refused
ERROR_FALLBACK: Final = error_code(PeerUnreachable)  # no direct path: fall back or give up


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Error(Frame):
    TAG: ClassVar[int] = 10
    code: int
    message: str
    session_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Goodbye(Frame):
    TAG: ClassVar[int] = 11
    reason: str = ""


# --- the per-frame schema, declared once ----------------------------------------------
# Each field name has one kind, the same in every frame that uses it; a frame's wire
# layout is its dataclass fields in order. Encoder, head parser and field validation
# all read the tables below (nothing else knows a frame's layout).

_STR, _BYTES, _INT, _UINT, _BOOL, _STRS, _PAIRS, _INTS, _TENSORS = range(9)
_KIND: Final[dict[str, int]] = {
    "peer_id": _STR,
    "host_id": _STR,
    "backends": _STRS,
    "endpoints": _PAIRS,
    "cuda": _BOOL,
    "nccl": _BOOL,
    "gloo": _BOOL,
    "deny": _STRS,
    "require_encryption": _BOOL,
    "encrypted": _BOOL,
    "credential_id": _BYTES,
    "credential_secret": _BYTES,
    "backend": _STR,
    "reason": _STR,
    "nonce": _BYTES,
    "mac": _BYTES,
    "session_id": _STR,
    "step": _UINT,
    "positions": _INTS,
    "tensors": _TENSORS,
    "token_ids": _INTS,
    "drafts": _INTS,
    "position": _UINT,
    "logprobs": _BYTES,
    "first_layer": _UINT,
    "start": _UINT,
    "code": _UINT,
    "message": _STR,
}


@dataclass(frozen=True, slots=True)
class FrameSchema:
    """One frame type on the wire: its record class, fields (name, kind) in wire order,
    and whether tensor bytes follow its header (only frames with a ``tensors`` field)."""

    cls: type[Frame]
    fields: tuple[tuple[str, int], ...]
    payload: bool


def _schema(cls: type[Frame]) -> FrameSchema:
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    return FrameSchema(cls, tuple((n, _KIND[n]) for n in names), "tensors" in names)


SCHEMAS: Final[dict[int, FrameSchema]] = {
    cls.TAG: _schema(cls)
    for cls in (
        Offer,
        Decision,
        Hello,
        Challenge,
        Proof,
        Activations,
        Tokens,
        KVBlock,
        Cancel,
        Error,
        Goodbye,
    )
}
FRAME_TYPES: Final[dict[int, type[Frame]]] = {tag: s.cls for tag, s in SCHEMAS.items()}
# frames whose header may grow to max_header_bytes (positions, token ids, tensor lists);
# every other is a control frame (Limits.max_control_header_bytes)
_BULK_TAGS: Final = frozenset((Activations.TAG, Tokens.TAG, KVBlock.TAG))
_KV_TAG: Final = KVBlock.TAG
# views of SCHEMAS keyed by class, for the encoder and Pending.build
_FIELDS: dict[type[Frame], tuple[str, ...]] = {
    s.cls: tuple(name for name, _ in s.fields) for s in SCHEMAS.values()
}
_SCHEMA: dict[type[Frame], tuple[tuple[str, int], ...]] = {
    s.cls: s.fields for s in SCHEMAS.values()
}
# _fast_header and _parse_items take a shortcut for the two hot frames, by position:
# refuse to load if a change to either frame's fields would make that shortcut wrong
_HOT_LAYOUTS: Final = {
    Tokens: ("session_id", "step", "token_ids", "position", "logprobs"),
    Activations: ("session_id", "step", "positions", "tensors", "drafts"),
}
if any(_FIELDS[cls] != names for cls, names in _HOT_LAYOUTS.items()):
    raise RuntimeError("the hot-path layouts of Tokens/Activations no longer match SCHEMAS")
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_TENSOR_FRAMES: Final = frozenset(s.cls for s in SCHEMAS.values() if s.payload)
_new = object.__new__
# slot setters per frame class, in field order, without ``tensors`` (see Pending.build)
_SETTERS: dict[type[Frame], tuple[Callable[[Any, Any], None], ...]] = {
    cls: tuple(getattr(cls, name).__set__ for name in names if name != "tensors")
    for cls, names in _FIELDS.items()
}
_TENSOR_SETTER: dict[type[Frame], Callable[[Any, Any], None]] = {
    cls: cls.tensors.__set__  # type: ignore[attr-defined]
    for cls in _TENSOR_FRAMES
}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_local(kind: int, name: str, value: Any, limits: Limits) -> Any:
    """Validate one field of a frame we are about to send; returns its wire value."""
    bad = False
    if kind == _STR:
        bad = not isinstance(value, str) or len(value.encode()) > limits.max_string_bytes
    elif kind == _BYTES:
        bad = not isinstance(value, bytes) or len(value) > limits.max_string_bytes
    elif kind in (_INT, _UINT):
        bad = type(value) is not int or not (
            (0 if kind == _UINT else _INT64_MIN) <= value <= _INT64_MAX
        )
    elif kind == _BOOL:
        bad = type(value) is not bool
    elif kind == _STRS:
        bad = not isinstance(value, tuple) or not all(isinstance(v, str) for v in value)
        value = list(value) if not bad else value
    elif kind == _PAIRS:
        bad = not isinstance(value, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in value
        )
        value = [list(p) for p in value] if not bad else value
    elif kind == _INTS:
        bad = (
            not isinstance(value, tuple)
            or len(value) > limits.max_items
            or not all(type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in value)
        )
        value = list(value) if not bad else value
    if bad:
        raise LocalProtocolError(f"frame field {name}={value!r:.80} is invalid")
    return value


_packers = threading.local()


def pack(header: list[Any]) -> bytes:
    """msgpack of ``header`` with a per-thread reused packer (``packb`` builds one per call)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    data: bytes = packer.pack(header)
    return data


def raw_buffer(t: torch.Tensor) -> Any:
    """A buffer-protocol object over the bytes of a contiguous CPU tensor (no copy).

    A numpy array (bfloat16 reinterpreted as int16), for ``sendmsg`` / ``recv_into``;
    :func:`flat_bytes` turns one into a flat byte ``memoryview``.
    """
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    try:
        return t.numpy()
    except RuntimeError:  # requires grad (or another view numpy refuses)
        return t.detach().resolve_conj().resolve_neg().numpy()


def flat_bytes(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = memoryview(buffer.reshape(-1)).cast("B")
    return view


def _describe(value: Any, limits: Limits, out: list[Any]) -> tuple[list[list[Any]], int]:
    """Header descriptions of a tensors field; appends each tensor's raw buffer to ``out``."""
    if type(value) is not tuple or len(value) > limits.max_tensors:
        raise LocalProtocolError("tensors must be a tuple within max_tensors")
    described = []
    payload = 0
    for t in value:
        if not isinstance(t, torch.Tensor):
            raise LocalProtocolError("tensors must hold torch.Tensor values")
        if not t.is_cpu or not t.is_contiguous():
            t = host_tensor(t)
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise LocalProtocolError(f"dtype {t.dtype} is not sendable")
        shape = t.shape
        nbytes = t.nbytes  # >= numel: numel() only when the cap could be crossed
        if len(shape) > limits.max_dims or (
            nbytes > limits.max_elements and t.numel() > limits.max_elements
        ):
            raise LocalProtocolError(f"tensor of shape {tuple(shape)} exceeds limits")
        described.append([dtype, list(shape), nbytes])
        out.append(raw_buffer(t))
        payload += nbytes
    return described, payload


_INT_TYPES: Final = frozenset((int,))


def _local_ints(value: Any, limits: Limits) -> list[int] | None:
    """``value`` as a list if it is a tuple of int64s within ``max_items``; else None."""
    if (
        type(value) is tuple
        and len(value) <= limits.max_items
        and set(map(type, value)) <= _INT_TYPES
        and (not value or (min(value) >= _INT64_MIN and max(value) <= _INT64_MAX))
    ):
        return list(value)
    return None


def _fast_header(frame: Frame, limits: Limits, out: list[Any]) -> tuple[list[Any], int] | None:
    """Header of an Activations or Tokens frame (the hot path), or None to go generic."""
    session_id, step = frame.session_id, frame.step  # type: ignore[attr-defined]
    if not (
        type(session_id) is str
        and len(session_id) * 4 <= limits.max_string_bytes
        and type(step) is int
        and 0 <= step <= _INT64_MAX
    ):
        return None
    if type(frame) is Tokens:
        ids = _local_ints(frame.token_ids, limits)
        position, logprobs = frame.position, frame.logprobs
        if ids is None or type(position) is not int or not 0 <= position <= _INT64_MAX:
            return None
        if type(logprobs) is not bytes or len(logprobs) > limits.max_string_bytes:
            return None
        return [session_id, step, ids, position, logprobs], 0
    assert isinstance(frame, Activations)
    positions = _local_ints(frame.positions, limits)
    if positions is None:
        return None
    described, payload = _describe(frame.tensors, limits, out)
    drafts = frame.drafts
    if not drafts:  # a plain step: the header without the field (as before issue 48)
        return [session_id, step, positions, described], payload
    checked = _local_ints(drafts, limits)
    if checked is None or len(checked) > MAX_DRAFTS:
        return None  # the generic path raises LocalProtocolError
    return [session_id, step, positions, described, checked], payload


def encode_parts(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> tuple[bytes, list[Any], int]:
    """``(prefix+header, raw tensor buffers, total bytes)``: :func:`encode` for gathering writes.

    The buffers are numpy arrays aliasing the tensors' memory, one per tensor
    (pass them to ``sendmsg``). Same checks and errors as :func:`encode`.
    """
    cls = type(frame)
    buffers: list[Any] = []
    fast = _fast_header(frame, limits, buffers) if cls is Activations or cls is Tokens else None
    if fast is None:
        buffers.clear()
        header, payload = _generic_header(frame, limits, buffers)
    else:
        header, payload = fast
    head = pack(header)
    if len(head) > limits.max_header_bytes or payload > limits.max_payload_bytes:
        raise LocalProtocolError(f"{cls.__name__} exceeds frame limits")
    head = PREFIX.pack(MAGIC, VERSION, cls.TAG, len(head), payload) + head
    return head, buffers, len(head) + payload


def _generic_header(frame: Frame, limits: Limits, out: list[Any]) -> tuple[list[Any], int]:
    cls = type(frame)
    schema = _SCHEMA.get(cls)
    if schema is None:
        raise LocalProtocolError(f"{cls.__name__} is not a frame type")
    header: list[Any] = []
    payload = 0
    for name, kind in schema:
        value = getattr(frame, name)
        if kind == _TENSORS:
            described, payload = _describe(value, limits, out)
            header.append(described)
        elif (
            kind == _STR and type(value) is str and len(value) * 4 <= limits.max_string_bytes
        ) or (kind == _UINT and type(value) is int and 0 <= value <= _INT64_MAX):
            header.append(value)
        else:
            header.append(_check_local(kind, name, value, limits))
            if name == "drafts" and len(value) > MAX_DRAFTS:
                raise LocalProtocolError(f"{len(value)} drafts, more than {MAX_DRAFTS}")
    return header, payload


def encode(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> list[bytes | memoryview]:
    """Serialise ``frame``: prefix+header bytes, then one memoryview per tensor (no copies).

    CUDA tensors are staged through pinned host memory. The memoryviews borrow
    the tensors' memory: write them out before mutating the tensors.
    Raises :class:`LocalProtocolError` for invalid fields or a frame over ``limits``.
    """
    head, buffers, _ = encode_parts(frame, limits)
    return [head, *(flat_bytes(b) for b in buffers)]


def encode_bytes(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The whole frame as one ``bytes`` (copies the payload: tests and small frames only)."""
    return b"".join(bytes(p) for p in encode(frame, limits))


# --- the frame-head parser: every reader (stream decoder, blocking socket reader, shm
# doorbell) checks a head through parse_prefix and parse_header, nowhere else --------


class FrameHead(NamedTuple):
    """A checked prefix: which frame follows, and the lengths of its header and payload."""

    cls: type[Frame]
    header_bytes: int
    payload_bytes: int


# a NamedTuple's own __new__ is Python code: 0.2 µs per frame that tuple.__new__ saves
_new_head: Final = tuple.__new__


def parse_prefix(
    data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, offset: int = 0
) -> FrameHead:
    """Check the 16-byte prefix at ``data[offset:]`` against ``limits``.

    Magic, version, a known tag, header and payload lengths under their caps,
    and no payload on a frame without tensors. Raises
    :class:`RemoteProtocolError` on any fault (a truncated prefix too).
    """
    if len(data) - offset < PREFIX_BYTES:
        raise RemoteProtocolError("truncated frame prefix")
    magic, version, tag, header_bytes, payload_bytes = PREFIX.unpack_from(data, offset)
    if magic != MAGIC:
        raise RemoteProtocolError("bad frame magic")
    if version != VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {version}")
    schema = SCHEMAS.get(tag)
    if schema is None:
        raise RemoteProtocolError(f"unknown frame tag {tag}")
    if header_bytes > limits.max_header_bytes:
        raise RemoteProtocolError(f"header of {header_bytes} bytes exceeds the cap")
    if header_bytes > limits.max_control_header_bytes and tag not in _BULK_TAGS:
        raise RemoteProtocolError(
            f"{schema.cls.__name__} header of {header_bytes} bytes: a control frame is small"
        )
    if payload_bytes > limits.max_payload_bytes:
        raise RemoteProtocolError(f"payload of {payload_bytes} bytes exceeds the cap")
    if payload_bytes:
        if not schema.payload:
            raise RemoteProtocolError(f"{schema.cls.__name__} cannot carry a payload")
        cap = limits.max_kv_block_bytes if tag == _KV_TAG else limits.max_activation_bytes
        if cap is not None and payload_bytes > cap:
            raise RemoteProtocolError(
                f"{schema.cls.__name__} payload of {payload_bytes} bytes: over the {cap} "
                "a frame of this model can need"
            )
    return _new_head(FrameHead, (schema.cls, header_bytes, payload_bytes))


def parse_header(
    head: FrameHead, header: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> Pending:
    """Decode and validate the msgpack header that follows ``head`` (exactly its bytes).

    Raises :class:`RemoteProtocolError` on any fault.
    """
    return _parse_items(head.cls, _unpack_header(header), head.payload_bytes, limits)


def parse_head(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Pending:
    """A whole head (prefix + header, nothing after it) from a packet; checked as above."""
    head = parse_prefix(data, limits)
    if len(data) != PREFIX_BYTES + head.header_bytes:
        raise RemoteProtocolError("frame head length does not match its prefix")
    return parse_header(head, memoryview(data)[PREFIX_BYTES:], limits)


def _check_remote(kind: int, value: Any, limits: Limits) -> Any:
    """Validate one header field sent by the peer; returns the frame's value."""
    if kind == _STR:
        if isinstance(value, str) and len(value) <= limits.max_string_bytes:
            return value
    elif kind == _BYTES:
        if isinstance(value, bytes) and len(value) <= limits.max_string_bytes:
            return value
    elif kind in (_INT, _UINT):
        if type(value) is int and (kind == _INT or value >= 0):
            return value
    elif kind == _BOOL:
        if type(value) is bool:
            return value
    elif kind == _STRS:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind == _PAIRS:
        if isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in value
        ):
            return tuple((p[0], p[1]) for p in value)
    elif kind == _INTS and (
        isinstance(value, list)
        and len(value) <= limits.max_items
        and all(type(v) is int for v in value)
    ):
        return tuple(value)
    raise RemoteProtocolError(f"malformed header field {value!r:.80}")


@dataclass(slots=True)
class Pending:
    """A parsed header whose tensor payload has yet to be read.

    ``specs`` says what to allocate; read ``sum(nbytes)`` payload bytes into
    the buffers, in order, then call :meth:`build`. ``values`` holds every
    field but ``tensors``, in declaration order.
    """

    cls: type[Frame]
    values: dict[str, Any]
    specs: tuple[TensorSpec, ...]

    def build(self, tensors: Sequence[torch.Tensor] = ()) -> Frame:
        """The frame, holding ``tensors`` (already of the specs' dtypes and shapes)."""
        cls = self.cls
        # the values were validated field by field already: fill the slots directly
        # (a frozen dataclass's __init__ costs ~3x more, and this runs once per frame)
        frame = _new(cls)
        for setter, value in zip(_SETTERS[cls], self.values.values(), strict=True):
            setter(frame, value)
        if cls in _TENSOR_FRAMES:
            if len(tensors) != len(self.specs):
                raise LocalProtocolError("one tensor per spec is needed")
            _TENSOR_SETTER[cls](frame, tuple(tensors))
        return frame

    def build_from_bytes(self, buffers: Sequence[torch.Tensor]) -> Frame:
        """The frame, with tensors viewing ``uint8`` ``buffers`` (one per spec, no copy)."""
        return self.build([as_tensor(b, s) for b, s in zip(buffers, self.specs, strict=True)])


def _remote_ints(value: Any, limits: Limits) -> tuple[int, ...]:
    if (
        type(value) is list
        and len(value) <= limits.max_items
        and set(map(type, value)) <= _INT_TYPES
    ):
        return tuple(value)
    raise RemoteProtocolError(f"malformed header field {value!r:.80}")


def _remote_specs(value: Any, limits: Limits) -> tuple[TensorSpec, ...]:
    if type(value) is not list or len(value) > limits.max_tensors:
        raise RemoteProtocolError("tensor list missing or too long")
    specs = []
    for d in value:
        if type(d) is not list or len(d) != 3:
            raise RemoteProtocolError("malformed tensor description")
        specs.append(
            checked_spec(
                d[0], d[1], d[2], max_dims=limits.max_dims, max_elements=limits.max_elements
            )
        )
    return tuple(specs)


def _parse_items(
    cls: type[Frame], items: Any, payload_bytes: int, limits: Limits = DEFAULT_LIMITS
) -> Pending:
    """Validate an unpacked msgpack header of a ``cls`` frame (for :func:`parse_header`)."""
    names = _FIELDS[cls]
    # a plain step's Activations header leaves its drafts out
    plain_step = cls is Activations and type(items) is list and len(items) == len(names) - 1
    if (type(items) is not list or len(items) != len(names)) and not plain_step:
        raise RemoteProtocolError(f"{cls.__name__} header has the wrong shape")
    specs: tuple[TensorSpec, ...] = ()
    values: dict[str, Any]
    if cls is Activations or cls is Tokens:  # the hot path: fixed layout, no per-field dispatch
        session_id, step = items[0], items[1]
        if type(session_id) is not str or len(session_id) > limits.max_string_bytes:
            raise RemoteProtocolError(f"malformed header field {session_id!r:.80}")
        if type(step) is not int or step < 0:
            raise RemoteProtocolError(f"malformed header field {step!r:.80}")
        ints = _remote_ints(items[2], limits)
        if cls is Tokens:
            position, logprobs = items[3], items[4]
            if type(position) is not int or position < 0:
                raise RemoteProtocolError(f"malformed header field {position!r:.80}")
            if type(logprobs) is not bytes or len(logprobs) > limits.max_string_bytes:
                raise RemoteProtocolError(f"malformed header field {logprobs!r:.80}")
            values = {"session_id": session_id, "step": step, "token_ids": ints}
            values["position"], values["logprobs"] = position, logprobs
        else:
            specs = _remote_specs(items[3], limits)
            values = {"session_id": session_id, "step": step, "positions": ints}
            drafts = _remote_ints(items[4], limits) if len(items) > 4 else ()
            if len(drafts) > MAX_DRAFTS:
                raise RemoteProtocolError(f"{len(drafts)} drafts, more than {MAX_DRAFTS}")
            values["drafts"] = drafts
    else:
        values = {}
        for name, value in zip(names, items, strict=True):
            kind = _KIND[name]
            if kind == _TENSORS:
                specs = _remote_specs(value, limits)
            else:
                values[name] = _check_remote(kind, value, limits)
    if sum(s.nbytes for s in specs) != payload_bytes:
        raise RemoteProtocolError("payload length does not match the tensor descriptions")
    if cls is KVBlock and limits.kv_block_bytes is not None:
        _check_kv_block(values["session_id"], payload_bytes, limits.kv_block_bytes)
    return Pending(cls, values, specs)


def _check_kv_block(
    session_id: str, payload_bytes: int, expected: Callable[[str], int | None]
) -> None:
    """A KVBlock's declared size against what its session can hold here, before its
    payload is read: none for a session not waiting for KV, at most its KV's shape."""
    cap = expected(session_id)
    if cap is None:
        raise RemoteProtocolError(f"no KV of session {session_id[:64]!r} is expected here")
    if payload_bytes > cap:
        raise RemoteProtocolError(
            f"a KVBlock of {payload_bytes} bytes for session {session_id[:64]!r}, whose KV "
            f"here is at most {cap}"
        )


def _unpack_header(header: bytes | bytearray | memoryview) -> Any:
    """msgpack-decode a peer's header; :class:`RemoteProtocolError` for garbage."""
    try:
        return msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage
        raise RemoteProtocolError(f"undecodable frame header: {exc}") from None


def _empty(spec: TensorSpec) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


class Decoder:
    """Incremental frame decoder for byte streams (sans-IO).

    ``allocate(spec)`` gives the tensor a payload is read into (a pool's
    ``acquire``; default ``torch.empty``); ``release`` gets the tensors of a
    frame that failed half way. Payload bytes are copied once,
    from the chunk handed to :meth:`receive_data` into the tensor.
    """

    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        *,
        allocate: Callable[[TensorSpec], torch.Tensor] | None = None,
        release: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self._limits = limits
        self._allocate = allocate or _empty
        self._release = release or (lambda t: None)
        self._buf = bytearray()
        self._prefix: FrameHead | None = None
        self._pending: Pending | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._slot = 0  # which tensor is being filled
        self._filled = 0  # bytes written into it
        self._failed = False

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has been received."""
        return bool(self._buf) or self._prefix is not None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the stream (any chunking)."""
        if self._failed:
            raise LocalProtocolError("decoder already failed")
        self._buf += data

    def next_frame(self) -> Frame | _NeedData:
        """The next complete frame, or :data:`NEED_DATA`.

        Raises :class:`RemoteProtocolError` for malformed input; the decoder
        is then dead and any partial tensors have been released.
        """
        if self._failed:
            raise LocalProtocolError("decoder already failed")
        try:
            return self._step()
        except RemoteProtocolError:
            self._failed = True
            self.abort()
            raise

    def abort(self) -> None:
        """Drop a partial frame and release its buffers (stream ended or failed)."""
        for b in self._buffers:
            self._release(b)
        self._buffers, self._views = [], []
        self._prefix, self._pending = None, None
        self._buf.clear()

    def _step(self) -> Frame | _NeedData:
        if self._prefix is None:
            if len(self._buf) < PREFIX_BYTES:
                return NEED_DATA
            self._prefix = parse_prefix(self._buf, self._limits)
            del self._buf[:PREFIX_BYTES]
        if self._pending is None:
            if len(self._buf) < self._prefix.header_bytes:
                return NEED_DATA
            n = self._prefix.header_bytes
            self._pending = parse_header(self._prefix, bytes(self._buf[:n]), self._limits)
            del self._buf[:n]
            self._buffers = [self._allocate(s) for s in self._pending.specs]
            self._views = [byte_view(b) for b in self._buffers]
            self._slot, self._filled = 0, 0
        taken = 0
        buf = memoryview(self._buf)
        try:
            while self._slot < len(self._views) and taken < len(buf):
                view = self._views[self._slot]
                n = min(len(view) - self._filled, len(buf) - taken)
                view[self._filled : self._filled + n] = buf[taken : taken + n]
                taken += n
                self._filled += n
                if self._filled == len(view):
                    self._slot += 1
                    self._filled = 0
            while self._slot < len(self._views) and len(self._views[self._slot]) == 0:
                self._slot += 1
        finally:
            buf.release()
        del self._buf[:taken]
        if self._slot < len(self._views):
            return NEED_DATA
        frame = self._pending.build(self._buffers)
        self._prefix, self._pending, self._buffers, self._views = None, None, [], []
        return frame


def decode_all(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Frame]:
    """Every frame in ``data`` (which must end on a frame boundary)."""
    decoder = Decoder(limits)
    decoder.receive_data(data)
    out: list[Frame] = []
    while not isinstance(frame := decoder.next_frame(), _NeedData):
        out.append(frame)
    if decoder.in_frame:
        raise RemoteProtocolError("data ends inside a frame")
    return out
