"""The gateway's fast turn: a decode step's token in, the next step out, on the link's
reader thread.

Before, a token from the last stage went: the link's reader thread → trio (a wake-up)
→ the link's receive task → :meth:`Gateway.on_frame` → the session's inbox → its
``_run`` generator → :meth:`Gateway._send_step` → the first stage. That turn (0.2–1.9
ms median on a loaded 2-vCPU box, docs/journal/2026-12-06-fast-cut.md) sat on every
token's critical path.

Now, before it waits for a decode step's token, the session *arms* its next step
(:meth:`GatewayLane.arm`: which step, at which position, from which last stage, to
which first stage). The reader thread that reads the awaited token (the link sink,
:meth:`GatewayLane.offer`) writes that next step to the first stage at once
(``send_now``: only if the link takes it without waiting), then hands the token on to
trio as before. ``_run`` then *claims* the arm (:meth:`GatewayLane.claim`): a step
already sent is not sent again. Anything unusual (an EOS token, another step or
position, another sender, a link that would wait, no arm) sends nothing here, and
``_run`` sends the step itself as before.

A session arms only a plain decode step: one token awaited, more wanted after it, no
split-prefill helper, no move under way or pending; a claimed step that fired stays
in flight like one ``_run`` sent. ``HETMESH_GATEWAY_LANE=0`` turns it off.

With several sessions the stages batch their steps, and steps sent one by one as
their tokens come in could split those batches: the first stage then gathers each
burst by the sessions that ran together (:mod:`hetmesh.node.stage_groups`), so the
lane arms every session while that is on; with ``HETMESH_STAGE_GROUPS=0``, or
``HETMESH_GATEWAY_LANE_MANY=0``, only the gateway's one session.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetmesh.errors import TransportError
from hetmesh.node.stage_groups import groups_enabled
from hetmesh.resources import PeerId
from hetmesh.transport.frames import Activations, Frame, Tokens

log = logging.getLogger(__name__)

MAX_ARRIVALS = 1024  # sessions whose token's arrival is kept (a gateway runs far fewer)

SendNow = Callable[[PeerId, Frame], bool]
"""Writes a frame to a peer's open link from any thread if it takes it at once."""


def gateway_lane_enabled() -> bool:
    """On unless ``HETMESH_GATEWAY_LANE=0`` (every step sent from trio, for comparisons)."""
    return os.environ.get("HETMESH_GATEWAY_LANE", "1") != "0"


def gateway_lane_own() -> bool:
    """Whether a next step for this node's own first stage runs on the reader thread
    that brings its token in, where that stage's device thread is parked for it
    (:mod:`hetmesh.node.stage_lane`): on unless ``HETMESH_GATEWAY_LANE_OWN=0`` (then
    it goes through trio, as any hop to this node)."""
    return os.environ.get("HETMESH_GATEWAY_LANE_OWN", "1") != "0"


def gateway_lane_many() -> bool:
    """Whether the lane arms every session of the gateway, not only a lone one: on
    unless ``HETMESH_GATEWAY_LANE_MANY=0``, and only while the stages gather bursts by
    their groups (:func:`~hetmesh.node.stage_groups.groups_enabled`)."""
    return os.environ.get("HETMESH_GATEWAY_LANE_MANY", "1") != "0" and groups_enabled()


@dataclass(slots=True)
class Armed:
    """A session's next decode step, to send when the awaited token comes in."""

    step: int  # the awaited token's step; the next step is step + 1
    position: int  # the awaited token's sequence position: the next step's input's
    last: PeerId  # who sends the token (the route's last stage)
    first: PeerId  # who takes the next step (the route's first stage)
    eos: frozenset[int]
    sent_at: float = 0.0  # perf_counter when the next step left (0: not sent)
    taken: bool = False  # a reader thread tried to send it (once: else trio sends it)


class GatewayLane:
    """The armed next steps of one gateway's sessions (thread-safe)."""

    def __init__(self, send_now: SendNow | None, me: PeerId = "") -> None:
        self._send_now = send_now
        self._me = me  # this node: a next step for its own first stage is its forward
        self._lock = threading.Lock()
        self._armed: dict[str, Armed] = {}
        # when each session's latest token reached this node (a reader thread, or this
        # node's last stage), for the turn the gateway measures: token in, next step out
        self._arrived: dict[str, float] = {}
        self.sent = 0  # next steps sent from a reader thread
        self.sent_beside_others = 0  # of those, sent while another session was armed too
        # of those, the ones to another node's first stage, and their turns in all (the
        # token in, the next step written); one to this node's own first stage runs
        # that stage's forward on this thread (gateway_lane_own): not a turn's cost
        self.turns = 0
        self.turn_s = 0.0

    @property
    def enabled(self) -> bool:
        return self._send_now is not None

    def arm(self, session_id: str, armed: Armed) -> None:
        with self._lock:
            self._armed[session_id] = armed

    def claim(self, session_id: str) -> Armed | None:
        """Disarm ``session_id``: its arm if the next step was sent, else None (send it)."""
        with self._lock:
            armed = self._armed.pop(session_id, None)
            if armed is None or not armed.sent_at:
                return None
            self._arrived.pop(session_id, None)  # its turn is counted: the lane's
        return armed

    def arrival(self, session_id: str) -> float | None:
        """When ``session_id``'s latest token came in (``perf_counter``; None: not seen
        here), forgotten once read."""
        with self._lock:
            return self._arrived.pop(session_id, None)

    def offer(self, sender: PeerId, frame: Frame) -> None:
        """On a link's reader thread, before trio gets ``frame``: if it is an armed
        session's awaited token, send that session's next step now. Never raises.

        The send runs outside the lane's lock: to a first stage on this node it is
        that stage's whole forward on this thread (``send_now``), and trio arms
        other sessions meanwhile. Trio claims this session only after this returns
        (the token reaches trio after it), so nobody else sends its step."""
        if type(frame) is not Tokens or not frame.token_ids:
            return
        arrived = time.perf_counter()
        with self._lock:
            if len(self._arrived) >= MAX_ARRIVALS:  # bounded: ended sessions' go too
                self._arrived.clear()
            self._arrived[frame.session_id] = arrived
            armed = self._armed.get(frame.session_id)
            if armed is None or armed.taken or self._send_now is None:
                return
            if sender != armed.last or frame.step != armed.step:
                return
            token = int(frame.token_ids[0])
            if frame.position != armed.position or token in armed.eos or token < 0:
                return
            armed.taken = True  # one try: trio sends it if this one does not
            send_now = self._send_now
        step = Activations(
            session_id=frame.session_id,
            step=armed.step + 1,
            positions=(armed.position,),
            tensors=(torch.tensor([token], dtype=torch.int64),),
        )
        try:
            sent = send_now(armed.first, step)
        except TransportError as exc:  # trio's send finds the link broken too
            log.debug("gateway lane: next step not sent: %s", exc)
            return
        if sent:
            with self._lock:
                armed.sent_at = time.perf_counter()
                self.sent += 1
                if armed.first != self._me:
                    self.turns += 1
                    self.turn_s += armed.sent_at - arrived
                self.sent_beside_others += len(self._armed) > 1
