"""What a stranger can make a data-plane listener parse before authentication."""

from __future__ import annotations

import random

import pytest

from hetmesh.errors import RemoteProtocolError
from hetmesh.transport.frames import (
    Activations,
    Frame,
    Hello,
    Proof,
    encode_bytes,
)
from hetmesh.transport.handshake import PREAUTH_LIMITS, parse_preauth

from .random_frames import mutate, random_blob, random_frame, random_text
from .test_frames import FUZZ_EXAMPLES


def test_preauth_parses_a_hello_and_a_proof_only() -> None:
    hello = Hello(peer_id="12D3KooW" + "x" * 44, credential_id=b"\1" * 16, nonce=b"\2" * 16)
    assert parse_preauth(encode_bytes(hello)) == hello
    assert parse_preauth(encode_bytes(Proof(mac=b"\3" * 32))) == Proof(mac=b"\3" * 32)
    with pytest.raises(RemoteProtocolError, match="before authentication"):
        parse_preauth(encode_bytes(Activations(session_id="s", step=0, positions=(), tensors=())))
    with pytest.raises(RemoteProtocolError):  # a Hello over the small caps
        parse_preauth(encode_bytes(Hello(peer_id="p" * 5000, credential_id=b"", nonce=b"")))


def preauth_input(seed: int) -> bytes:
    """Any frame's encoding (Hellos half the time), then 0-4 random edits."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        frame: Frame = Hello(
            peer_id=random_text(rng, 80),
            credential_id=random_blob(rng),
            nonce=random_blob(rng),
        )
    else:
        frame = random_frame(rng)
    return mutate(rng, encode_bytes(frame), least=0)


@pytest.mark.slow  # 10,000 examples: a few seconds on a loaded machine
def test_preauth_fuzz_parses_a_small_hello_or_proof_or_refuses() -> None:
    first = random.SystemRandom().randrange(2**48)  # a failure names its seed
    for seed in range(first, first + FUZZ_EXAMPLES):
        data = preauth_input(seed)
        try:
            frame = parse_preauth(data)
        except RemoteProtocolError:
            continue
        except Exception as exc:
            raise AssertionError(f"seed {seed}: {exc!r}") from exc
        assert isinstance(frame, (Hello, Proof)), f"seed {seed}"
        assert len(data) <= 16 + PREAUTH_LIMITS.max_header_bytes, f"seed {seed}"
