"""A frame's declared size is checked against what its kind may carry, on the prefix."""

from __future__ import annotations

import socket

import msgpack
import pytest
import torch

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.codec import BufferPool, TensorSpec
from hetmesh.transport.frames import (
    MAGIC,
    PREFIX,
    VERSION,
    Activations,
    Cancel,
    Decoder,
    Error,
    KVBlock,
    Limits,
    decode_all,
    encode_bytes,
    limits_for_model,
    parse_prefix,
)
from hetmesh.transport.links import BufferedReader

# the default model's shape (SmolLM2-135M): 576 wide, 30 layers of 3 KV heads of 64
HIDDEN, CONTEXT, KV_PER_TOKEN = 576, 8192, 30 * 2 * 3 * 64 * 4
MODEL = limits_for_model(hidden_size=HIDDEN, max_context=CONTEXT, kv_bytes_per_token=KV_PER_TOKEN)


def _prefix(cls: type, header_bytes: int, payload_bytes: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, cls.TAG, header_bytes, payload_bytes)


def test_a_control_frame_declaring_a_large_header_is_refused_on_its_prefix() -> None:
    """A Cancel has a session id and a reason: a header of 1 MiB (the cap of frames with
    positions or token ids) is refused before a byte of it is buffered."""
    with pytest.raises(RemoteProtocolError, match="control frame"):
        parse_prefix(_prefix(Cancel, 1 << 20, 0))
    decoder = Decoder()
    decoder.receive_data(_prefix(Error, 512 << 10, 0))
    with pytest.raises(RemoteProtocolError, match="control frame"):
        decoder.next_frame()
    # control frames as they are sent still pass, a long message included
    long = Error(code=1, message="x" * (60 << 10), session_id="s")
    assert decode_all(encode_bytes(long)) == [long]


@pytest.mark.parametrize(
    ("cls", "payload"),
    [
        (KVBlock, 4 << 30),  # the whole 4 GiB the wire allows
        (KVBlock, 2 * CONTEXT * KV_PER_TOKEN + 1),  # just past the model's bound
        (Activations, 1 << 30),
        (Activations, 2 * CONTEXT * HIDDEN * 4 + 1),
    ],
)
def test_a_bulk_frame_larger_than_the_model_can_need_is_refused_before_allocation(
    cls: type, payload: int
) -> None:
    allocated: list[TensorSpec] = []

    def allocate(spec: TensorSpec) -> torch.Tensor:
        allocated.append(spec)
        return torch.empty(spec.shape, dtype=torch.uint8)

    decoder = Decoder(MODEL, allocate=allocate)
    decoder.receive_data(_prefix(cls, 64, payload))  # the prefix alone: no header yet
    with pytest.raises(RemoteProtocolError, match="a frame of this model can need"):
        decoder.next_frame()
    assert allocated == []


def test_the_blocking_reader_refuses_it_on_the_prefix_too() -> None:
    header = msgpack.packb(["s", 0, 0, [["float32", [1 << 28], 1 << 30]]])
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_prefix(KVBlock, len(header), 1 << 30) + header)  # and never the payload
        reader = BufferedReader(b, MODEL, BufferPool())
        with pytest.raises(RemoteProtocolError, match="a frame of this model can need"):
            reader.read_pending()


def test_frames_of_the_models_own_shape_pass() -> None:
    hidden = torch.zeros(CONTEXT, HIDDEN)  # a whole-context prefill, float32
    frame = Activations(session_id="s", step=0, positions=tuple(range(CONTEXT)), tensors=(hidden,))
    assert decode_all(encode_bytes(frame), MODEL) == [frame]
    kv = torch.zeros(30, 3, 1024, 64)  # keys and values of 1,024 positions
    block = KVBlock(session_id="s", first_layer=0, start=0, tensors=(kv, kv.clone()))
    assert decode_all(encode_bytes(block), MODEL) == [block]
    assert MODEL.max_kv_block_bytes is not None
    assert MODEL.max_kv_block_bytes < Limits().max_payload_bytes
