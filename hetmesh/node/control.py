"""Session control messages between a gateway and the stages of a pipeline.

They travel on the libp2p control plane (``SESSION_PROTOCOL``), one request
and one reply per stream, as length-prefixed msgpack maps (the framing of
:mod:`hetmesh.discovery.wire`). Tensors never travel here: token ids and
hidden states go over the data plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetmesh.error_codec import error_from_wire, error_name
from hetmesh.errors import MeshError, RemoteProtocolError
from hetmesh.protocol.generate import SamplingParams
from hetmesh.resources import PeerId, WireRecord

SESSION_PROTOCOL = "/hetmesh/session/1.0.0"
MAX_CONTROL_BYTES = 64 * 1024
# a stage holding the whole model generates up to this many tokens from one feed
# (OpenSession.feed_steps), and learns at most this many end-of-sequence ids
MAX_FEED_STEPS = 32
MAX_STOP_IDS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenSession(WireRecord):
    """Ask a stage to hold a session's KV cache and where to send its outputs."""

    session_id: str
    start: int
    end: int
    next_peer: PeerId  # the next stage, or the gateway for the last stage
    gateway: PeerId
    # the stage before this one ("": the gateway, which feeds the first stage): the only
    # peer whose activations the stage accepts for this session
    previous_peer: PeerId = ""
    max_tokens: int
    prompt_tokens: int = 0  # the first chunk it will get (prompt, or history on a replay)
    sampling: SamplingParams  # applied by the last stage; the gateway always sets its seed
    # chained hashes of the prompt's full blocks (partition.prefix.block_hashes): the
    # stage starts from the blocks it has cached and names its own once computed
    prefix_hashes: tuple[int, ...] = ()
    # a migration (hetmesh.node.migration): the peer whose KV of ``prompt_tokens`` tokens
    # this stage takes instead of computing them; "" for a session that starts here
    migrate_from: PeerId = ""
    # the request's place in every stage's admission queue (kvcache.Stamp): the wall
    # time of its gateway's first try and a tie-break id, the same on every try and
    # resume; "" for none (the stage orders it by arrival)
    order_s: float = 0.0
    order_id: str = ""
    # tokens the stage generates from each step its gateway sends: after the first it
    # feeds itself each sampled token, until ``feed_steps``, an id of ``stop_ids`` or
    # ``max_tokens`` (a stage holding the whole model only; 1: one token a step)
    feed_steps: int = 1
    stop_ids: tuple[int, ...] = ()
    # a prompt's prefill split between two peers holding the same units
    # (hetmesh.node.split): the unit where its chunks cross from one to the other (0:
    # none). With ``helper``, this stage runs units [split, end) of the prompt on the
    # hidden states ``helper`` sends, then loads the KV of units [start, split) from it;
    # without, this stage is the helper: it runs units [start, split) of the prompt and
    # sends those hidden states, then that KV, to ``next_peer``
    split: int = 0
    helper: PeerId = ""
    # a grammar-constrained session resumed on a new last stage (a replay, a move): the
    # tokens it drew before, which that stage's grammar takes before its next draw
    drawn: tuple[int, ...] = ()
    op: str = "open"

    def __post_init__(self) -> None:
        if not 1 <= self.feed_steps <= MAX_FEED_STEPS:
            raise ValueError(f"feed_steps must be within [1, {MAX_FEED_STEPS}]")
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids")
        if self.split and not self.start < self.split < self.end:
            raise ValueError(f"split must lie within ({self.start}, {self.end})")
        if self.helper and not self.split:
            raise ValueError("a helper helps with a split prefill only")
        if self.split and not self.helper and self.feed_steps != 1:
            raise ValueError("a split prefill's helper samples nothing: feed_steps 1")
        if len(self.drawn) > self.max_tokens:
            raise ValueError("more tokens drawn than the session may hold")


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseSession(WireRecord):
    session_id: str
    # hashes of the full blocks of the session's whole history (prompt and generated):
    # the stage keeps those it holds in its prefix cache (a conversation's next turn)
    block_hashes: tuple[int, ...] = ()
    op: str = "close"


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveSession(WireRecord):
    """From a session's gateway, between two steps: the session's route changes.

    With ``kv_to`` this stage sends the session's KV to that peer (opened
    there with ``migrate_from``) and lets the session go; without, it keeps
    the session and takes its activations from ``previous_peer`` and sends
    its outputs to ``next_peer`` from now on.
    """

    session_id: str
    kv_to: PeerId = ""
    next_peer: PeerId = ""
    previous_peer: PeerId = ""
    op: str = "move"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply(WireRecord):
    """``ok``, or the error's wire name (:func:`hetmesh.errors.error_name`) as ``kind``.

    A stage refuses with ``Rejected`` (busy), ``InvalidRequest`` or ``NoRoute``
    (it does not serve those units: the plan moved).
    """

    ok: bool
    kind: str = ""
    message: str = ""
    cached_tokens: int = 0  # an open: prompt tokens this stage holds cached already

    @classmethod
    def failed(cls, exc: MeshError) -> Reply:
        return cls(ok=False, kind=error_name(exc), message=str(exc))

    def error(self) -> MeshError | None:
        """The exception an error reply stands for; None when ``ok``."""
        if self.ok:
            return None
        kind = self.kind or error_name(MeshError)
        return error_from_wire(kind, self.message or "stage refused the request")

    def raise_for_error(self) -> None:
        """Turn an error reply into the matching exception."""
        error = self.error()
        if error is not None:
            raise error


Request = OpenSession | CloseSession | MoveSession


def parse_request(data: dict[str, Any]) -> Request:
    """Decode a control request map, or raise :class:`RemoteProtocolError`."""
    op = data.get("op")
    try:
        if op == "open":
            return OpenSession.from_wire(data)
        if op == "close":
            return CloseSession.from_wire(data)
        if op == "move":
            return MoveSession.from_wire(data)
    except ValueError as exc:
        raise RemoteProtocolError(f"malformed session request: {exc}") from exc
    raise RemoteProtocolError(f"unknown session operation {op!r}")
