"""What a stranger can make a data-plane listener parse before authentication."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.frames import (
    Activations,
    Hello,
    Proof,
    encode_bytes,
)
from hetmesh.transport.handshake import PREAUTH_LIMITS, parse_preauth

from .test_frames import FUZZ, frames


def test_preauth_parses_a_hello_and_a_proof_only() -> None:
    hello = Hello(peer_id="12D3KooW" + "x" * 44, credential_id=b"\1" * 16, nonce=b"\2" * 16)
    assert parse_preauth(encode_bytes(hello)) == hello
    assert parse_preauth(encode_bytes(Proof(mac=b"\3" * 32))) == Proof(mac=b"\3" * 32)
    with pytest.raises(RemoteProtocolError, match="before authentication"):
        parse_preauth(encode_bytes(Activations(session_id="s", step=0, positions=(), tensors=())))
    with pytest.raises(RemoteProtocolError):  # a Hello over the small caps
        parse_preauth(encode_bytes(Hello(peer_id="p" * 5000, credential_id=b"", nonce=b"")))


@st.composite
def preauth_inputs(draw: st.DrawFn) -> bytes:
    """Any frame's encoding (Hellos often), then a few random edits."""
    if draw(st.booleans()):
        frame = Hello(
            peer_id=draw(st.text(max_size=80)),
            credential_id=draw(st.binary(max_size=40)),
            nonce=draw(st.binary(max_size=40)),
        )
    else:
        frame = draw(frames)
    data = bytearray(encode_bytes(frame))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@pytest.mark.slow  # 2,000 examples: ~10 s on a loaded machine
@settings(FUZZ, max_examples=min(2000, FUZZ.max_examples))
@given(preauth_inputs())
def test_preauth_fuzz_parses_a_small_hello_or_proof_or_refuses(data: bytes) -> None:
    try:
        frame = parse_preauth(data)
    except RemoteProtocolError:
        return
    assert isinstance(frame, (Hello, Proof))
    assert len(data) <= 16 + PREAUTH_LIMITS.max_header_bytes
