"""Random data-plane frames and mutations of their bytes, drawn with ``random.Random``.

For the decoder's fuzz tests, whose subject is the decoder, not the drawing: a
Hypothesis strategy per field cost ~88 % of those tests' time (a profile of the
mutated-frames fuzz), a seeded ``random.Random`` a small part of it. Every frame
type is drawn (``FRAME_DRAWERS`` is checked against ``FRAME_TYPES``), with the
same field ranges as the round-trip tests' Hypothesis strategy, and a seed
reproduces an example exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from hetmesh.transport.codec import DTYPES
from hetmesh.transport.frames import (
    Activations,
    Cancel,
    Challenge,
    Decision,
    Error,
    Frame,
    Goodbye,
    Hello,
    KVBlock,
    Offer,
    Proof,
    Tokens,
    encode_bytes,
)

# code points a text may hold: ASCII often, then the rest of the BMP and beyond
# (surrogates excluded: they have no UTF-8 form, as Hypothesis's text() excludes them)
_RANGES = ((0x20, 0x7E), (0x00, 0x1F), (0x80, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF))
_DTYPE_NAMES = sorted(DTYPES)


def random_text(rng: random.Random, max_size: int = 20) -> str:
    out = []
    for _ in range(rng.randint(0, max_size)):
        lo, hi = _RANGES[0] if rng.random() < 0.7 else rng.choice(_RANGES[1:])
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def random_blob(rng: random.Random, max_size: int = 40) -> bytes:
    return rng.randbytes(rng.randint(0, max_size))


def _uint(rng: random.Random) -> int:
    return rng.choice((0, 1, 2**63 - 1, rng.randint(0, 1000), rng.randint(0, 2**63 - 1)))


def _int_tuple(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randint(-(2**63), 2**63 - 1) for _ in range(rng.randint(0, 8)))


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = DTYPES[rng.choice(_DTYPE_NAMES)]
    shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
    count = int(torch.Size(shape).numel())
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = bytearray(rng.randbytes(count * size))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def _tensors(rng: random.Random) -> tuple[torch.Tensor, ...]:
    return tuple(_tensor(rng) for _ in range(rng.randint(0, 3)))


def _texts(rng: random.Random, most: int) -> tuple[str, ...]:
    return tuple(random_text(rng) for _ in range(rng.randint(0, most)))


FRAME_DRAWERS: dict[type[Frame], Callable[[random.Random], Frame]] = {
    Offer: lambda r: Offer(
        peer_id=random_text(r),
        host_id=random_text(r),
        backends=_texts(r, 4),
        endpoints=tuple((random_text(r), random_text(r)) for _ in range(r.randint(0, 3))),
        cuda=r.random() < 0.5,
        nccl=r.random() < 0.5,
        gloo=r.random() < 0.5,
        deny=_texts(r, 2),
        require_encryption=r.random() < 0.5,
        credential_id=random_blob(r),
        credential_secret=random_blob(r),
    ),
    Decision: lambda r: Decision(
        backend=random_text(r), reason=random_text(r), encrypted=r.random() < 0.5
    ),
    Hello: lambda r: Hello(
        peer_id=random_text(r), credential_id=random_blob(r), nonce=random_blob(r)
    ),
    Challenge: lambda r: Challenge(nonce=random_blob(r)),
    Proof: lambda r: Proof(mac=random_blob(r)),
    Activations: lambda r: Activations(
        session_id=random_text(r),
        step=_uint(r),
        positions=_int_tuple(r),
        tensors=_tensors(r),
        drafts=_int_tuple(r),
    ),
    Tokens: lambda r: Tokens(session_id=random_text(r), step=_uint(r), token_ids=_int_tuple(r)),
    KVBlock: lambda r: KVBlock(
        session_id=random_text(r), first_layer=_uint(r), start=_uint(r), tensors=_tensors(r)
    ),
    Cancel: lambda r: Cancel(session_id=random_text(r), reason=random_text(r)),
    Error: lambda r: Error(code=_uint(r), message=random_text(r), session_id=random_text(r)),
    Goodbye: lambda r: Goodbye(reason=random_text(r)),
}
_KINDS = list(FRAME_DRAWERS.values())


def random_frame(rng: random.Random) -> Frame:
    """One frame of a type chosen uniformly, its fields drawn from ``rng``."""
    return rng.choice(_KINDS)(rng)


def mutate(rng: random.Random, data: bytes, least: int = 1) -> bytes:
    """``data`` after ``least``-4 random edits: a bit flipped, up to 8 bytes cut, or inserted."""
    out = bytearray(data)
    for _ in range(rng.randint(least, 4)):
        op = rng.randrange(3)
        i = rng.randint(0, max(0, len(out) - 1))
        if op == 0 and out:
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del out[i : i + rng.randint(1, 8)]
        else:
            out[i:i] = rng.randbytes(rng.randint(1, 8))
    return bytes(out)


def mutated_frame(seed: int) -> bytes:
    """The bytes of one random frame, mutated; the same ``seed`` gives the same bytes."""
    rng = random.Random(seed)
    return mutate(rng, encode_bytes(random_frame(rng)))
