"""The dial-back service: learn (and announce) whether members can reach this node.

:class:`Reachability` runs beside discovery, on its authenticated control
plane (only members holding the mesh secret can open a stream):

- it answers :data:`~hetmesh.nat.reachability.DIALBACK_PROTOCOL` requests (not
  over a relayed connection, where it would see the relay's address): the
  requester's announced TCP addresses at the IP the request came from are
  dialled, and the requester's link-probe port there must then prove the mesh
  secret (:func:`hetmesh.discovery.probe.probe_link`, a few KiB), so an
  unrelated host that happens to listen at that address is not mistaken for
  it. At most :data:`MAX_CONCURRENT_ANSWERS` requests are answered at once;
- it asks up to ``ask`` alive members to dial it back — soon after it joins,
  again every ``retry_s`` while the answer is unknown, every ``nat_every_s``
  while behind NAT and every ``every_s`` once public — and publishes the
  verdict in its record (``extra["reach"]``);
- when it is behind NAT and no member is public, it logs one warning saying
  what to do (once per change).

Raises nothing to its caller but ``trio.Cancelled``: a member that cannot be
asked, or answers nonsense, is skipped (and logged at debug level).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery import wire
from hetmesh.discovery.probe import probe_link
from hetmesh.errors import MeshError, PeerUnreachable
from hetmesh.nat.reachability import (
    BEHIND_NAT,
    DIALBACK_PROTOCOL,
    EXTRA_KEY,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    UNKNOWN,
    DialbackReply,
    DialbackRequest,
    advice,
    dialable,
    no_member_advice,
    reach_of,
    tcp_endpoint,
    to_wire,
    verdict,
)
from hetmesh.nat.state import NatState
from hetmesh.transport.p2p import control_path

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from hetmesh.discovery.service import Discovery

log = logging.getLogger(__name__)

MAX_CONCURRENT_ANSWERS = 4
DIAL_TIMEOUT_S = 3.0  # a TCP connect to a reachable address
# the probe port's proof: its server runs one bulk transfer at a time, so a dial-back
# may wait behind a link probe on a busy member (not a sign of NAT)
PROOF_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ReachabilityStatistics:
    reach: str  # public / behind NAT / unknown
    asked: int  # dial-back requests this node sent
    answered: int  # ... that were answered
    answers_sent: int  # requests of others this node answered
    reached_by: tuple[str, ...]  # members that reached us in the last round


async def reaches(ip: str, port: int, probe_port: int, psk: str) -> bool:
    """True if ``ip:port`` accepts a TCP connection and ``ip:probe_port`` proves the secret."""
    with trio.move_on_after(DIAL_TIMEOUT_S) as connect:
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        await stream.aclose()
    if connect.cancelled_caught:
        return False
    if not probe_port:
        return True
    try:
        await probe_link(ip, probe_port, psk, nbytes=4096, timeout_s=PROOF_TIMEOUT_S)
    except (PeerUnreachable, MeshError):
        return False
    return True


class Reachability:
    """One node's dial-back client and server (see the module doc)."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        ask: int = 3,
        retry_s: float = 5.0,
        every_s: float = 300.0,
        nat_every_s: float = 20.0,
        first_after_s: float = 1.0,
        nat: NatState | None = None,
    ) -> None:
        """``nat``: where the public IP members see us from is recorded (behind NAT: our
        side of a hole punch), the node's one traversal state (None: one of its own)."""
        self.discovery = discovery
        self.nat = nat if nat is not None else NatState()
        self.ask = ask
        self.retry_s = retry_s
        self.every_s = every_s
        self.nat_every_s = nat_every_s
        self.first_after_s = first_after_s
        self.reach = UNKNOWN
        self._asked = 0
        self._answered = 0
        self._answers_sent = 0
        self._reached_by: tuple[str, ...] = ()
        self._advised: str | None = None
        self._nat_rounds = 0  # consecutive rounds that found us behind NAT
        self.alone_after_s = 30.0  # no member this long (after joining through bootstrap): say so
        self._alone_since: float | None = None
        self._said_alone = False
        self._answering = trio.Semaphore(MAX_CONCURRENT_ANSWERS)
        self._rng = random.Random()

    def statistics(self) -> ReachabilityStatistics:
        return ReachabilityStatistics(
            reach=self.reach,
            asked=self._asked,
            answered=self._answered,
            answers_sent=self._answers_sent,
            reached_by=self._reached_by,
        )

    # -- answering members --------------------------------------------------------

    async def _handle(self, stream: Any) -> None:
        if control_path(stream) == "relayed":
            # over a relay we see the relay's address, not the asker's: no answer, so
            # the asker counts nothing (rather than a false "behind NAT")
            return
        remote = stream.get_remote_address()
        observed = str(remote[0]) if remote else None
        blob = await wire.read_frame(stream, max_bytes=MAX_REQUEST_BYTES, timeout_s=5.0)
        request = DialbackRequest.decode(blob)
        targets = dialable(request.addrs, observed)
        reached = ""
        async with self._answering:
            for addr, ip, port in targets:
                if await reaches(ip, port, request.probe_port, self.discovery.psk):
                    reached = addr
                    break
        self._answers_sent += 1
        reply = DialbackReply(bool(reached), reached, observed or "", len(targets))
        await wire.write_frame(stream, reply.encode())

    # -- asking members -----------------------------------------------------------

    async def _ask(self, peer_id: str, request: bytes, replies: dict[str, DialbackReply]) -> None:
        self._asked += 1
        try:
            blob = await self.discovery.request(
                peer_id,
                DIALBACK_PROTOCOL,
                request,
                max_reply_bytes=MAX_REPLY_BYTES,
                timeout_s=2 * (DIAL_TIMEOUT_S + PROOF_TIMEOUT_S),
            )
            replies[peer_id] = DialbackReply.decode(blob)
            self._answered += 1
        except (MeshError, trio.TooSlowError):
            log.debug("no dial-back answer from %s", peer_id, exc_info=True)

    async def check_once(self) -> str:
        """Ask up to ``ask`` alive members; publish and return the verdict."""
        me = self.discovery.peer_id
        members = [e.peer_id for e in self.discovery.alive() if e.peer_id != me]
        self._check_alone(len(members))
        self._rng.shuffle(members)
        request = DialbackRequest(
            tuple(a for a in self.discovery.addrs if tcp_endpoint(a) is not None)[:8],
            self.discovery.probe_port,
        ).encode()
        replies: dict[str, DialbackReply] = {}
        async with trio.open_nursery() as nursery:
            for peer_id in members[: self.ask]:
                nursery.start_soon(self._ask, peer_id, request, replies)
        reach = verdict(list(replies.values()))
        self._reached_by = tuple(sorted(p for p, r in replies.items() if r.reached))
        observed = sorted({r.observed for r in replies.values() if r.observed})
        # behind NAT, the IP members see us from is our side of a hole punch
        if reach != UNKNOWN:
            self.nat.set_public_ip(
                observed[0] if reach == BEHIND_NAT and len(observed) == 1 else None
            )
        if reach != self.reach:
            log.info("reachability: %s (members seeing us from %s)", reach, observed or "?")
        self.reach = reach
        self._nat_rounds = self._nat_rounds + 1 if reach == BEHIND_NAT else 0
        self.discovery.set_extra(EXTRA_KEY, to_wire(reach))
        self._advise()
        return reach

    def _check_alone(self, members: int) -> None:
        """Say once (until members return) that a node that joined through bootstrap
        reaches nobody any more."""
        bootstrap = self.discovery.config.bootstrap
        now = trio.current_time()
        if members or not bootstrap:
            self._alone_since, self._said_alone = None, False
            return
        if self._alone_since is None:
            self._alone_since = now
        if not self._said_alone and now - self._alone_since >= self.alone_after_s:
            log.warning("%s", no_member_advice(bootstrap))
            self._said_alone = True

    def _advise(self) -> None:
        others = [
            reach_of({"extra": e.record.extra})
            for e in self.discovery.alive()
            if e.record is not None and e.peer_id != self.discovery.peer_id
        ]
        ports = [tcp_endpoint(a) for a in self.discovery.addrs]
        port = next((p[1] for p in ports if p is not None), None)
        line = advice(self.reach, others, port)
        # members still finding out may yet turn out public: wait for them a few rounds
        if line is not None and UNKNOWN in others and self._nat_rounds < 3:
            return
        if line is not None and line != self._advised:
            log.warning("%s", line)
        self._advised = line

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer dial-backs and keep our verdict current; never returns."""
        self.discovery.add_handler(DIALBACK_PROTOCOL, self._handle)
        self.discovery.set_extra(EXTRA_KEY, to_wire(UNKNOWN))
        task_status.started()
        await trio.sleep(self.first_after_s)
        while True:
            reach = await self.check_once()
            # behind NAT: ask again sooner (a port may be opened, a public member join)
            wait = {UNKNOWN: self.retry_s, BEHIND_NAT: self.nat_every_s}.get(reach, self.every_s)
            deadline = trio.current_time() + wait
            while trio.current_time() < deadline:  # losing every member is noticed sooner
                await trio.sleep(min(10.0, max(deadline - trio.current_time(), 0.0)))
                me = self.discovery.peer_id
                self._check_alone(sum(e.peer_id != me for e in self.discovery.alive()))


__all__ = ["Reachability", "ReachabilityStatistics", "reaches"]
