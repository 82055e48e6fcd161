"""Log-probabilities of sampled tokens, from the last stage to the gateway (pure).

A request asking for them (``SamplingParams.logprobs``: how many alternatives)
has its last stage compute, where it samples, the log-probability of the token
it drew and of the ``logprobs`` most likely tokens, from the model's own
distribution (``log_softmax`` of the logits: before temperature, top-k, top-p
or a grammar's mask, as OpenAI reports them). They travel in the
:class:`~hetmesh.transport.frames.Tokens` frame's ``logprobs`` field, packed by
:func:`pack` (little-endian: the drawn token's ``float32`` log-probability,
then ``int32`` id and ``float32`` log-probability per alternative, most
likely first), and reach the gateway's consumer as a :class:`Sampled`: an
``int`` (the token id, usable wherever an id is) that carries them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hetmesh.errors import RemoteProtocolError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs
_HEAD = struct.Struct("<f")
_PAIR = struct.Struct("<if")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The drawn token's log-probability and the ``top`` alternatives (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def pack(info: TokenLogprobs) -> bytes:
    """The wire bytes of ``info`` (see the module's layout)."""
    return _HEAD.pack(info.logprob) + b"".join(_PAIR.pack(i, lp) for i, lp in info.top)


def unpack(data: bytes) -> TokenLogprobs:
    """:func:`pack`'s inverse; ``RemoteProtocolError`` for bytes of the wrong shape."""
    rest = len(data) - _HEAD.size
    if rest < 0 or rest % _PAIR.size or rest // _PAIR.size > MAX_TOP_LOGPROBS:
        raise RemoteProtocolError(f"malformed logprobs of {len(data)} bytes")
    (logprob,) = _HEAD.unpack_from(data)
    top = tuple(_PAIR.iter_unpack(data[_HEAD.size :]))
    return TokenLogprobs(float(logprob), tuple((int(i), float(lp)) for i, lp in top))


class Sampled(int):
    """A sampled token id that carries its :class:`TokenLogprobs` (``logprobs``)."""

    logprobs: TokenLogprobs

    def __new__(cls, token: int, logprobs: TokenLogprobs) -> Sampled:
        self = super().__new__(cls, token)
        self.logprobs = logprobs
        return self

    def wire(self) -> bytes:
        return pack(self.logprobs)


def logprobs_of(token: int) -> TokenLogprobs | None:
    """The log-probabilities ``token`` carries, if it is a :class:`Sampled`."""
    return token.logprobs if isinstance(token, Sampled) else None


def token_of(token_id: int, logprobs: bytes) -> int:
    """A received token: a :class:`Sampled` when log-probabilities came with it."""
    return Sampled(token_id, unpack(logprobs)) if logprobs else int(token_id)


def wire_of(token: int) -> bytes:
    """The bytes a token frame carries for ``token`` (empty: none asked)."""
    return token.wire() if isinstance(token, Sampled) else b""


__all__ = [
    "MAX_TOP_LOGPROBS",
    "Sampled",
    "TokenLogprobs",
    "logprobs_of",
    "pack",
    "token_of",
    "unpack",
    "wire_of",
]
