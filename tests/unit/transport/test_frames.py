"""Frames and the decoder: round trips, caps before allocation, fuzzing."""

from __future__ import annotations

import os
import random
import socket
import struct
from collections.abc import Callable

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.errors import LocalProtocolError, RemoteProtocolError
from hetmesh.transport.codec import DTYPES, BufferPool, TensorSpec
from hetmesh.transport.frames import (
    DEFAULT_LIMITS,
    FRAME_TYPES,
    MAGIC,
    NEED_DATA,
    PREFIX,
    SCHEMAS,
    VERSION,
    Activations,
    Cancel,
    Challenge,
    Decision,
    Decoder,
    Error,
    Frame,
    Goodbye,
    Hello,
    KVBlock,
    Limits,
    Offer,
    Proof,
    Tokens,
    decode_all,
    encode,
    encode_bytes,
    encode_parts,
    parse_head,
    parse_prefix,
)
from hetmesh.transport.links import BufferedReader
from hetmesh.transport.shm import parse_doorbell
from tests.unit.transport.random_frames import FRAME_DRAWERS, mutated_frame, random_frame

# CI runs every fuzz test (the decoder's here, the handshake's and the sealed socket's) with
# >= 10,000 examples; set HETMESH_FUZZ_EXAMPLES to shorten locally.
FUZZ_EXAMPLES = int(os.environ.get("HETMESH_FUZZ_EXAMPLES", "10000"))
ROUND_TRIP = settings(max_examples=300, deadline=None)

texts = st.text(max_size=20)
blobs = st.binary(max_size=40)
ints = st.integers(min_value=0, max_value=2**63 - 1)
int_tuples = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=8).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=DTYPES[dtype]).element_size()
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    return (
        flat.view(DTYPES[dtype]).reshape(shape)
        if nbytes
        else torch.empty(shape, dtype=DTYPES[dtype])
    )


tensor_tuples = st.lists(tensors(), max_size=3).map(tuple)
frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(
        Offer,
        peer_id=texts,
        host_id=texts,
        backends=st.lists(texts, max_size=4).map(tuple),
        endpoints=st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
        cuda=st.booleans(),
        nccl=st.booleans(),
        gloo=st.booleans(),
        deny=st.lists(texts, max_size=2).map(tuple),
        require_encryption=st.booleans(),
        credential_id=blobs,
        credential_secret=blobs,
    ),
    st.builds(Decision, backend=texts, reason=texts),
    st.builds(Hello, peer_id=texts, credential_id=blobs, nonce=blobs),
    st.builds(Challenge, nonce=blobs),
    st.builds(Proof, mac=blobs),
    st.builds(
        Activations,
        session_id=texts,
        step=ints,
        positions=int_tuples,
        tensors=tensor_tuples,
        drafts=int_tuples,
    ),
    st.builds(Tokens, session_id=texts, step=ints, token_ids=int_tuples),
    st.builds(KVBlock, session_id=texts, first_layer=ints, start=ints, tensors=tensor_tuples),
    st.builds(Cancel, session_id=texts, reason=texts),
    st.builds(Error, code=ints, message=texts, session_id=texts),
    st.builds(Goodbye, reason=texts),
)


def test_frames_strategy_covers_every_frame_type() -> None:
    covered = {
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
    }
    assert covered == set(FRAME_TYPES.values())


@ROUND_TRIP
@given(frames)
def test_frames_round_trip_whole(frame: Frame) -> None:
    assert decode_all(encode_bytes(frame)) == [frame]


@ROUND_TRIP
@given(frames)
def test_frames_encode_parts_is_encode_for_gathering_writes(frame: Frame) -> None:
    head, buffers, total = encode_parts(frame)
    data = head + b"".join(memoryview(b).tobytes() for b in buffers)
    assert data == encode_bytes(frame)
    assert total == len(data)
    assert len(buffers) == len(frame.tensors_())


def test_frames_decoded_frames_are_still_frozen() -> None:
    import dataclasses

    (frame,) = decode_all(encode_bytes(Tokens(session_id="s", step=1, token_ids=(1, 2))))
    assert isinstance(frame, Tokens)
    assert frame == Tokens(session_id="s", step=1, token_ids=(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        frame.step = 2  # type: ignore[misc]


@ROUND_TRIP
@given(st.lists(frames, min_size=1, max_size=3))
def test_frames_round_trip_byte_at_a_time(batch: list[Frame]) -> None:
    data = b"".join(encode_bytes(f) for f in batch)
    decoder = Decoder()
    out = []
    for i in range(len(data)):
        decoder.receive_data(data[i : i + 1])
        while (frame := decoder.next_frame()) is not NEED_DATA:
            out.append(frame)
    assert out == batch
    assert not decoder.in_frame


def test_frames_bfloat16_is_bit_exact_including_nan() -> None:
    raw = torch.tensor([0x7FC1, -128, 0x0001, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    frame = Activations(session_id="s", step=1, positions=(0, 1), tensors=(raw,))
    (back,) = decode_all(encode_bytes(frame))
    assert isinstance(back, Activations)
    assert back.tensors[0].view(torch.int16).tolist() == raw.view(torch.int16).tolist()


def test_frames_encode_sends_tensor_memory_without_copy() -> None:
    t = torch.arange(1024, dtype=torch.float32)
    parts = encode(Activations(session_id="s", step=0, positions=(), tensors=(t,)))
    view = parts[1]
    assert isinstance(view, memoryview)
    t[0] = 42.0  # the view aliases the tensor's memory
    assert struct.unpack("<f", view[:4])[0] == 42.0


def test_frames_non_contiguous_tensor_is_sent_by_value() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    (back,) = decode_all(
        encode_bytes(KVBlock(session_id="s", first_layer=0, start=0, tensors=(t,)))
    )
    assert isinstance(back, KVBlock)
    assert torch.equal(back.tensors[0], t)


@pytest.mark.parametrize(
    "frame",
    [
        Tokens(session_id="s", step=-1, token_ids=()),
        Tokens(session_id="s", step=True, token_ids=()),
        Tokens(session_id="s", step=0, token_ids=(2**64,)),
        Activations(
            session_id="s", step=0, positions=(), tensors=(torch.zeros(2, dtype=torch.complex64),)
        ),
        Hello(peer_id="p", credential_id="not-bytes", nonce=b""),  # type: ignore[arg-type]
    ],
)
def test_frames_invalid_outgoing_frame_is_local_error(frame: Frame) -> None:
    with pytest.raises(LocalProtocolError):
        encode(frame)


def _raw(
    tag: int,
    header: object,
    payload: bytes = b"",
    *,
    payload_len: int | None = None,
    version: int = VERSION,
    magic: bytes = MAGIC,
) -> bytes:
    head: bytes = msgpack.packb(header, use_bin_type=True)
    n = len(payload) if payload_len is None else payload_len
    return PREFIX.pack(magic, version, tag, len(head), n) + head + payload


class _Recorder:
    def __init__(self) -> None:
        self.allocated: list[TensorSpec] = []

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        self.allocated.append(spec)
        return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])


ACT = Activations.TAG
REFUSED = {
    "bad magic": _raw(ACT, ["s", 0, [], []], magic=b"XX"),
    "future version": _raw(ACT, ["s", 0, [], []], version=VERSION + 1),
    "unknown tag": _raw(200, []),
    "oversize header": PREFIX.pack(MAGIC, VERSION, ACT, (1 << 20) + 1, 0),
    "oversize payload": PREFIX.pack(MAGIC, VERSION, ACT, 10, (4 << 30) + 1),
    "payload on a control frame": _raw(Goodbye.TAG, [""], payload_len=4),
    "huge shape": _raw(
        ACT, ["s", 0, [], [["float32", [1 << 20, 1 << 20], 4 << 40]]], payload_len=(4 << 30)
    ),
    "negative dim": _raw(ACT, ["s", 0, [], [["float32", [-1, 4], -16]]], payload_len=0),
    "unknown dtype": _raw(ACT, ["s", 0, [], [["complex64", [2], 16]]], payload_len=16),
    "too many dims": _raw(ACT, ["s", 0, [], [["uint8", [1] * 9, 1]]], payload_len=1),
    "too many tensors": _raw(ACT, ["s", 0, [], [["uint8", [1], 1]] * 65], payload_len=65),
    "nbytes lies": _raw(ACT, ["s", 0, [], [["float32", [4], 4]]], payload_len=4),
    "payload length lies": _raw(ACT, ["s", 0, [], [["float32", [4], 16]]], payload_len=8),
    "bool as int": _raw(Tokens.TAG, ["s", True, []]),
    "negative step": _raw(Tokens.TAG, ["s", -3, []]),
    "bool token id": _raw(Tokens.TAG, ["s", 1, [1, True]]),
    "float position": _raw(Activations.TAG, ["s", 1, [1.0], []]),
    "bytes session id": _raw(Activations.TAG, [b"s", 1, [], []]),
    "activations step not int": _raw(Activations.TAG, ["s", "1", [], []]),
    "activations tensors not a list": _raw(Activations.TAG, ["s", 1, [], {}]),
    "bool dim": _raw(Activations.TAG, ["s", 1, [], [["float32", [True], 4]]], b"\0" * 4),
    "nbytes mismatch": _raw(Activations.TAG, ["s", 1, [], [["float32", [2], 4]]], b"\0" * 4),
    "wrong field count": _raw(Tokens.TAG, ["s", 1]),
    "header not a list": _raw(Tokens.TAG, {"a": 1}),
    "garbage header": PREFIX.pack(MAGIC, VERSION, Tokens.TAG, 3, 0) + b"\xc1\xc1\xc1",
}


@pytest.mark.parametrize("data", list(REFUSED.values()), ids=list(REFUSED))
def test_decoder_refuses_before_allocating(data: bytes) -> None:
    recorder = _Recorder()
    decoder = Decoder(allocate=recorder)
    decoder.receive_data(data + b"\0" * 64)
    with pytest.raises(RemoteProtocolError):
        _drain(decoder)
    assert recorder.allocated == []


def _drain(decoder: Decoder) -> None:
    while decoder.next_frame() is not NEED_DATA:
        pass


def test_decoder_custom_limits_apply() -> None:
    data = encode_bytes(Tokens(session_id="s", step=0, token_ids=tuple(range(20))))
    with pytest.raises(RemoteProtocolError):
        decode_all(data, Limits(max_items=10))


def test_decoder_abort_releases_partial_tensors() -> None:
    pool = BufferPool()
    data = encode_bytes(
        Activations(session_id="s", step=0, positions=(), tensors=(torch.ones(4096),))
    )
    decoder = Decoder(allocate=pool.acquire, release=pool.release)
    decoder.receive_data(data[: len(data) // 2])
    assert decoder.next_frame() is NEED_DATA
    assert pool.statistics().in_use_bytes == 4096 * 4
    decoder.abort()
    assert pool.statistics().in_use_bytes == 0


def _feed(data: bytes, chunk: int) -> None:
    decoder = Decoder()
    try:
        for i in range(0, len(data), chunk):
            decoder.receive_data(data[i : i + chunk])
            while decoder.next_frame() is not NEED_DATA:
                pass
    except RemoteProtocolError:
        pass


def _fuzz(name: str, draw: Callable[[int], bytes]) -> None:
    """Feed ``draw(seed)`` for FUZZ_EXAMPLES seeds to the decoder, whole and one byte at a
    time: each parses or raises ``RemoteProtocolError``. A failure names its seed
    (``draw(seed)`` rebuilds the bytes); the seeds start somewhere new each run."""
    first = random.SystemRandom().randrange(2**48)
    for seed in range(first, first + FUZZ_EXAMPLES):
        data = draw(seed)
        try:
            _feed(data, len(data) or 1)
            _feed(data, 1)
        except Exception as exc:
            raise AssertionError(f"{name}: seed {seed}, bytes {data.hex()}: {exc!r}") from exc


def _random_bytes(seed: int) -> bytes:
    rng = random.Random(seed)
    return rng.randbytes(rng.randint(0, 200))


def test_decoder_fuzz_random_bytes() -> None:
    _fuzz("random bytes", _random_bytes)


def test_decoder_fuzz_mutated_frames() -> None:
    _fuzz("mutated frame", mutated_frame)


def test_random_frames_cover_every_frame_type_and_round_trip() -> None:
    """The fuzz's frame drawer draws every frame type, and what it draws is a valid frame."""
    assert set(FRAME_DRAWERS) == set(FRAME_TYPES.values())
    rng = random.Random(7)
    seen: set[type[Frame]] = set()
    for _ in range(300):
        frame = random_frame(rng)
        seen.add(type(frame))
        assert decode_all(encode_bytes(frame)) == [frame]
    assert seen == set(FRAME_TYPES.values())
    assert mutated_frame(11) == mutated_frame(11)


def _read_from_socket(data: bytes, pool: BufferPool) -> None:
    """The blocking socket reader (tcp, torchdist headers) on ``data`` then EOF."""
    left, right = socket.socketpair()
    try:
        left.sendall(data)
        left.shutdown(socket.SHUT_WR)
        BufferedReader(right, DEFAULT_LIMITS, pool).read_frame()
    finally:
        left.close()
        right.close()


def _read_doorbell(data: bytes) -> None:
    """The shm doorbell's whole-packet check, with ``data`` as the packet's frame head."""
    (header_bytes,) = struct.unpack_from(">I", data, 4)
    head = data[: PREFIX.size + header_bytes]
    parse_doorbell(msgpack.packb([0, head, [], []]), 0, DEFAULT_LIMITS)


@pytest.mark.parametrize("reader", ["socket", "doorbell"])
@pytest.mark.parametrize("data", list(REFUSED.values()), ids=list(REFUSED))
def test_every_reader_refuses_the_heads_the_decoder_refuses(data: bytes, reader: str) -> None:
    """One head parser: the blocking socket reader and the shm doorbell refuse the same
    heads as the stream decoder, with the same error, before allocating anything."""
    pool = BufferPool()
    with pytest.raises(RemoteProtocolError):
        _read_from_socket(data + b"\0" * 64, pool) if reader == "socket" else _read_doorbell(data)
    assert pool.statistics().in_use_bytes == 0
    assert pool.statistics().cached_bytes == 0


def test_parse_prefix_reads_at_an_offset_and_checks_lengths() -> None:
    data = encode_bytes(Tokens(session_id="s", step=2, token_ids=(5, 6)))
    head = parse_prefix(b"xyz" + data, DEFAULT_LIMITS, 3)
    assert head.cls is Tokens
    assert head.payload_bytes == 0
    assert PREFIX.size + head.header_bytes == len(data)
    pending = parse_head(data[: PREFIX.size + head.header_bytes])
    assert pending.build() == Tokens(session_id="s", step=2, token_ids=(5, 6))
    with pytest.raises(RemoteProtocolError, match="truncated"):
        parse_prefix(data[:15])
    with pytest.raises(RemoteProtocolError, match="length"):
        parse_head(data + b"\0")  # a packet's head must be exactly prefix + header
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        parse_prefix(data, Limits(max_header_bytes=2))


def test_schemas_declare_every_frame_once() -> None:
    assert {tag: s.cls for tag, s in SCHEMAS.items()} == FRAME_TYPES
    for tag, schema in SCHEMAS.items():
        assert tag == schema.cls.TAG
        assert schema.payload == any(name == "tensors" for name, _ in schema.fields)
    assert {s.cls for s in SCHEMAS.values() if s.payload} == {Activations, KVBlock}
