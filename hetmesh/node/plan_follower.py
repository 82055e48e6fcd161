"""The plan to follow: a peer view in, the plan and announcement changes out.

Every node runs the same code; the coordinator (chosen by standing, not id:
:func:`~hetmesh.scheduler.coordination.choose_coordinator`) is the only one that
plans, and signs what it publishes with its libp2p identity key;
a node follows only plans its own coordinator signed, within an epoch window,
that are sane on its view (:mod:`hetmesh.scheduler.plan_trust`), and ignores
(and logs, once a minute per peer) any other. :meth:`PlanFollower.step`
gathers a :class:`~hetmesh.scheduler.coordination.MeshView` from the records,
lets the pure :func:`~hetmesh.scheduler.coordination.decide` choose (adopt a
peer's plan, publish a new one, or keep) and returns what changed: the plans
adopted (with their signatures) and the verdict to announce. It touches no
stage; the node's root carries the result out. A plan it follows stands against
drifted measurements for a while once it serves
(:class:`~hetmesh.scheduler.replan.DriftHold`): the serving loop tells it when the
plan became ready.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetmesh.discovery.wire import Announcement
from hetmesh.node.config import ServingConfig
from hetmesh.node.peer_view import PeerView
from hetmesh.node.weights import QUANTIZED_ORDER
from hetmesh.resources import DeviceProfile, LinkProfile, ModelProfile, PeerId
from hetmesh.scheduler.announcement import read_offer
from hetmesh.scheduler.coordination import (
    Adopt,
    CoordinatorConfig,
    CoordinatorState,
    MeshView,
    Publish,
    choose_coordinator,
    decide,
)
from hetmesh.scheduler.holdings import unheld_units, unheld_verdict
from hetmesh.scheduler.plan_trust import (
    Offer,
    PlanSignature,
    epoch_floor,
    plan_message,
    plan_refusal,
    term_floor,
)
from hetmesh.scheduler.records import Plan, PlanConstraints, WeightBytes
from hetmesh.scheduler.replan import DriftHold, MeshSnapshot

if TYPE_CHECKING:
    from hetmesh.shards.fetch import Shards

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 60.0
MAX_VERIFIED = 256  # cached signature checks (a few plans are announced at a time)
# the entries of a record's ``extra`` its offer is read from (read_offer)
OFFER_KEYS = ("serving_version", "plan", "plan_signature")
# the entries calibrated_constraints, quota_constraints and weights_constraints read
# (each through read_serving: the version, the calibration, the host, the format)
CONSTRAINT_KEYS = ("serving_version", "calibration", "host", "weights")
# the entry of a record's ``data_plane`` that names its host (serving.announced_host)
HOST_KEY = "host"
MAX_HOST_CHARS = 64
COMPACT_HINT = (  # what a coordinator that cannot place the model says of the formats
    "; nodes started with --weights bfloat16, int8 or int4 hold about 1/2, 1/4 or 1/7 "
    "of float32's weight bytes"
)


@dataclass(frozen=True, slots=True)
class Followed:
    """What one step changed: the plans adopted, in order, each with the signature to
    relay; the new verdict to announce (None: unchanged); the links to measure."""

    adopted: tuple[tuple[Plan, PlanSignature | None], ...] = ()
    insufficient: str | None = None
    missing_links: tuple[tuple[PeerId, PeerId], ...] = ()


@dataclass(frozen=True, slots=True)
class _Verdict:
    """:func:`plan_refusal`'s answer for ``offer`` as judged with ``judged`` (the
    coordinator, the plan followed and its signer, the devices, the constraints)."""

    offer: Offer
    judged: tuple[object, ...]
    why: str

    def holds(self, offer: Offer, judged: tuple[object, ...]) -> bool:
        """Whether the answer stands for ``offer`` judged with ``judged``: the same
        offer object, the same plan followed (object) and equal other inputs."""
        mine = self.judged
        return (
            offer is self.offer
            and judged[1] is mine[1]
            and judged[0] == mine[0]
            and judged[2:] == mine[2:]
        )


def snapshot(records: Sequence[Announcement]) -> tuple[MeshSnapshot, list[tuple[str, str]]]:
    """The mesh the records describe (``records[0]``: this node's), and the candidate
    links nobody measured yet."""

    def capacity(d: DeviceProfile) -> DeviceProfile:
        # plan on the device's whole memory: what our own stages hold is ours to use
        return dataclasses.replace(d, memory_free_bytes=d.memory_total_bytes)

    ids = {r.peer_id for r in records}
    # a record speaks for its sender only: another peer's device, or a link that
    # does not start at the sender, is not the sender's to announce
    devices = tuple(capacity(d) for r in records for d in r.devices if d.peer_id == r.peer_id)
    links: dict[tuple[str, str], LinkProfile] = {}
    for r in records:
        for link in r.links:
            if link.src == r.peer_id and link.dst in ids:
                links[(link.src, link.dst)] = link
    pairs = [(s, d) for s in sorted(ids) for d in sorted(ids) if s != d]
    missing = [p for p in pairs if p not in links]
    hosts = tuple(sorted((r.peer_id, h) for r in records if (h := record_host(r))))
    mesh = MeshSnapshot(devices=devices, links=tuple(links[k] for k in sorted(links)), hosts=hosts)
    return mesh, missing


def loopback_floors(
    mesh: MeshSnapshot, seen: Mapping[tuple[PeerId, PeerId], LinkProfile]
) -> tuple[MeshSnapshot, dict[tuple[PeerId, PeerId], LinkProfile]]:
    """``mesh`` with each loopback link (:meth:`MeshSnapshot.loopback_links`) at the best it
    was measured (the lowest RTT, the highest bandwidth, in ``seen`` or now), and the
    new best of each, for the next call (the links of ``mesh`` only: bounded).

    Two processes of one host measure each other's round trip and copy rate as soon
    as the CPU runs them: under load only ever worse, several times the quiet figure,
    and back. A plan made then would cost loopback hops at the load's price (the
    exactness run of 2026-12-12 predicted a 27 % gain from it); the best figure is the
    link's own.
    """
    best: dict[tuple[PeerId, PeerId], LinkProfile] = {}
    links: list[LinkProfile] = []
    loopback = mesh.loopback_links()
    for link in mesh.links:
        key = (link.src, link.dst)
        if key not in loopback:
            links.append(link)
            continue
        before = seen.get(key)
        if before is not None:
            link = dataclasses.replace(
                link,
                rtt_s=min(link.rtt_s, before.rtt_s),
                bandwidth_bps=max(link.bandwidth_bps, before.bandwidth_bps),
            )
        best[key] = link
        links.append(link)
    if not best:
        return mesh, best
    return dataclasses.replace(mesh, links=tuple(links)), best


def record_host(record: Announcement) -> str:
    """The host ``record``'s sender names in its data-plane entry ("" if none, or not a
    short string: such a peer shares a host with nobody)."""
    plane = record.data_plane if isinstance(record.data_plane, Mapping) else {}
    host = plane.get(HOST_KEY, "")
    return host if isinstance(host, str) and len(host) <= MAX_HOST_CHARS else ""


def unheld(view: PeerView, profile: ModelProfile, shards: Shards | None) -> str:
    """Why no plan can serve the model when no live member (nor this node, holding
    ``shards``) holds some of its units ("" without shards: nothing to say)."""
    if shards is None:
        return ""
    manifest = shards.manifest_id
    holdings = [(manifest, shards.units_held())] + [
        (m.serving.manifest, m.serving.units_held) for m in view.members
    ]
    return unheld_verdict(profile.name, unheld_units(profile.num_units, holdings, manifest))


class PlanFollower:
    """Decides the plan this node follows; see the module docstring."""

    def __init__(
        self,
        *,
        me: PeerId,
        profile: ModelProfile,
        constraints: PlanConstraints,
        config: ServingConfig,
        started_at: float,
        key: Any,
        bytes_of: Callable[[str], WeightBytes | None],
    ) -> None:
        self.me = me
        self.profile = profile
        self.model_key = profile.name
        self.constraints = constraints
        self.coordinator_config = CoordinatorConfig(
            model=profile,
            strategy=config.plan_strategy,
            objective=config.objective,
            standby=config.standby,
            compact_formats=frozenset(QUANTIZED_ORDER),
            compact_hint=COMPACT_HINT,
        )
        self.settle_s = config.settle_s
        self.started_at = started_at
        self.key = key  # this node's libp2p identity key: it signs the plans made here
        self.bytes_of = bytes_of
        self.coordination = CoordinatorState()  # the plan followed, ours, the last verdict
        self.boss: PeerId | None = None  # the coordinator the last step named
        # the signatures of the plans that passed plan_refusal this turn (relayed on adoption)
        self._signatures: list[tuple[Plan, PlanSignature]] = []
        self._verified: dict[tuple[str, str, bytes], bool] = {}  # (signer, sig, message)
        self._refusal_logged: dict[PeerId, float] = {}  # peer -> when we last said so
        self._corrected: frozenset[str] = frozenset()  # devices planned on measured steps
        self._corrected_logged = -REFUSAL_LOG_INTERVAL_S
        self.drift_hold = DriftHold()  # how long the followed plan stands against drift
        # what a tick re-derived from plans that did not change: each peer's offer
        # (kept while its record's plan entries are equal), each offer's verdict and
        # the signed floors (kept while the offer objects are the same): a plan tick
        # parsed every record's plan and re-encoded every plan's JSON to check its
        # signature, each second, on every node
        self._offers: dict[PeerId, tuple[tuple[object, ...], Offer | None]] = {}
        self._verdicts: dict[PeerId, _Verdict] = {}
        self._floors: tuple[tuple[Offer, ...], int, int] = ((), -1, -1)
        # each loopback link's best measurement so far (loopback_floors)
        self._loopback: dict[tuple[PeerId, PeerId], LinkProfile] = {}
        # the constraints the announcements' calibrations, hosts and formats gave
        self._announced_constraints: tuple[object, PlanConstraints] | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan this node follows."""
        return self.coordination.plan

    @property
    def refused(self) -> frozenset[PeerId]:
        """The peers whose plans this node refused (and logged) so far."""
        return frozenset(self._refusal_logged)

    @property
    def insufficient(self) -> str:
        """Why the coordinator cannot place the model ("" when it can, or we do not plan)."""
        return self.coordination.insufficient

    @property
    def planned_on(self) -> MeshSnapshot | None:
        """The mesh the followed plan was last judged on (None: judge it afresh)."""
        return self.coordination.planned_on

    def step(
        self,
        local: Announcement,
        view: PeerView,
        now: float,
        unheld: str = "",
        *,
        ready: bool = False,
    ) -> Followed:
        """Decide on the mesh ``local`` (this node's record) and ``view`` describe;
        ``unheld``: units no live member holds (no plan can serve them); ``ready``:
        whether the followed plan serves (a pipeline fully ready)."""
        self.drift_hold.observe(now, ready=ready)
        mesh, missing = self._view(local, view, now)
        step = decide(mesh, self.coordination, self.coordinator_config)
        if unheld:
            step = dataclasses.replace(
                step,
                state=dataclasses.replace(self.coordination, insufficient=unheld),
                actions=(),
            )
        before, self.coordination = self.coordination, step.state
        verdict = step.state.insufficient
        changed: str | None = None
        if verdict != before.insufficient:  # announced: gateways refuse requests at once
            if verdict:
                log.warning("cannot place %s on this mesh yet: %s", self.model_key, verdict)
            changed = verdict
        adopted: list[tuple[Plan, PlanSignature | None]] = []
        drifted: Plan | None = None  # a plan drift alone made here this step
        for action in step.actions:
            if isinstance(action, Publish):
                drifted = action.plan if action.drift else drifted
                log.info(
                    "plan epoch %d (%s): %s; predicted %.1f ms/token",
                    action.plan.epoch,
                    action.reason,
                    " | ".join(
                        " → ".join(f"{s.peer_id[-6:]}[{s.start},{s.end})" for s in p.stages)
                        for p in action.plan.pipelines
                    ),
                    action.plan.decode_latency_s * 1e3,
                )
            elif isinstance(action, Adopt):
                if action.made_here:
                    signature: PlanSignature | None = self.sign(action.plan)
                else:  # relayed as the coordinator signed it
                    signature = next((g for p, g in self._signatures if p is action.plan), None)
                adopted.append((action.plan, signature))
                self.drift_hold.adopted(now, drift=action.plan is drifted)
        return Followed(tuple(adopted), changed, tuple(missing))

    def _view(
        self, local: Announcement, view: PeerView, now: float
    ) -> tuple[MeshView, list[tuple[str, str]]]:
        """What the coordinator decides on: the mesh now, gathered from the announcements."""
        members = [m for m in view.members if m.record is not None]
        records = [local] + [m.record for m in members if m.record is not None]
        mesh, missing = snapshot(records)
        mesh, self._loopback = loopback_floors(mesh, self._loopback)
        constraints = self._constraints(local, records[1:], mesh.devices, now)
        peers = tuple(m.peer_id for m in members)
        offers = [o for r in records[1:] if (o := self._offer(r)) is not None]
        following = {o.relayed_by: o.signature.signer for o in offers if o.signature}
        boss = self.boss = choose_coordinator(
            (self.me, *peers),
            me=self.me,
            plan=self.plan,
            signer=self.coordination.signer,
            following=following,
        )
        self._signatures = []
        verdicts: dict[PeerId, _Verdict] = {}
        for offer in offers:
            judged = (boss, self.plan, self.coordination.signer, mesh.devices, constraints)
            verdict = self._verdicts.get(offer.relayed_by)
            if verdict is None or not verdict.holds(offer, judged):
                why = plan_refusal(
                    offer,
                    coordinator=boss,
                    current=self.plan,
                    current_signer=self.coordination.signer,
                    devices=mesh.devices,
                    model=self.profile,
                    constraints=constraints,
                    verify=self._verify,
                )
                verdict = _Verdict(offer, judged, why)
            verdicts[offer.relayed_by] = verdict
            if verdict.why:
                self._refused(offer, verdict.why, now)
            elif offer.signature is not None:
                self._signatures.append((offer.plan, offer.signature))
        self._verdicts = verdicts
        epochs, terms = self._signed_floors(offers)
        return MeshView(
            me=self.me,
            peers=peers,
            snapshot=mesh,
            constraints=constraints,
            plans=tuple(p for p, _ in self._signatures),
            settled=now - self.started_at >= self.settle_s,
            drift_allowed=self.drift_hold.allows(now),
            epoch_floor=epochs,  # signed plans only (issue 45)
            term_floor=terms,  # a new coordinator's term above it
            following=tuple(following.items()),
        ), missing

    def _offer(self, record: Announcement) -> Offer | None:
        """The plan ``record`` offers, parsed again only when the entries it is read
        from changed (a record changes with its sender's memory and counters too)."""
        extra = record.extra if isinstance(record.extra, Mapping) else {}
        raw = tuple(extra.get(key) for key in OFFER_KEYS)
        cached = self._offers.get(record.peer_id)
        if cached is not None and cached[0] == raw:
            return cached[1]
        offer = read_offer(record.extra, record.peer_id)
        if len(self._offers) >= MAX_VERIFIED:  # bounded: gone peers' entries go too
            self._offers.clear()
        self._offers[record.peer_id] = (raw, offer)
        return offer

    def _signed_floors(self, offers: Sequence[Offer]) -> tuple[int, int]:
        """:func:`epoch_floor` and :func:`term_floor` of ``offers`` (again only when an
        offer changed: each checks a signature over the plan's JSON)."""
        seen, epochs, terms = self._floors
        if len(seen) != len(offers) or any(a is not b for a, b in zip(seen, offers, strict=False)):
            epochs, terms = epoch_floor(offers, self._verify), term_floor(offers, self._verify)
            self._floors = (tuple(offers), epochs, terms)
        return epochs, terms

    def sign(self, plan: Plan) -> PlanSignature:
        """This node's signature of ``plan``, with its libp2p identity key."""
        signature = self.key.sign(plan_message(plan))
        return PlanSignature(signer=self.me, signature=bytes(signature).hex())

    def _constraints(
        self,
        local: Announcement,
        records: Sequence[Announcement],
        devices: Sequence[DeviceProfile],
        now: float,
    ) -> PlanConstraints:
        from hetmesh.node.calibration import calibrated_constraints, measured_constraints
        from hetmesh.node.weights import weights_constraints
        from hetmesh.scheduler.announcement import quota_constraints

        announced = [(r.peer_id, r.extra) for r in (local, *records)]
        # each of the three reads every record's serving entries in full; they read
        # only the entries CONSTRAINT_KEYS name, so they run again only when those
        # (or the devices) changed
        key = (
            tuple(
                (peer, *(extra.get(k) for k in CONSTRAINT_KEYS))
                for peer, extra in announced
                if isinstance(extra, Mapping)
            ),
            len(announced),
            tuple(devices),
            self.constraints,
        )
        if self._announced_constraints is not None and self._announced_constraints[0] == key:
            constraints = self._announced_constraints[1]
        else:
            constraints = calibrated_constraints(self.constraints, self.model_key, announced)
            constraints = quota_constraints(constraints, announced)  # shares of a core (42)
            constraints = weights_constraints(constraints, announced, devices, self.bytes_of)
            self._announced_constraints = (key, constraints)
        # claims against what the stages serving the plan measure: a member far slower
        # than it claimed is planned on its measurement (at the next replan)
        observed = {r.peer_id: r.load.recent_step_s for r in records}
        observed[local.peer_id] = local.load.recent_step_s
        constraints, corrected = measured_constraints(constraints, self.plan, observed)
        if corrected - self._corrected and now - self._corrected_logged >= REFUSAL_LOG_INTERVAL_S:
            self._corrected_logged = now  # at most once a minute: the set moves with load
            log.info(
                "planning %s on measured step times: far slower than claimed",
                ", ".join(sorted(corrected - self._corrected)),
            )
        self._corrected = corrected
        return constraints

    def _refused(self, offer: Offer, why: str, now: float) -> None:
        """Say (at most once a minute per peer) that a peer's announced plan is ignored."""
        peer = offer.relayed_by
        if now - self._refusal_logged.get(peer, -REFUSAL_LOG_INTERVAL_S) >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged[peer] = now
            log.warning(
                "ignoring the plan %s announces (epoch %d): %s", peer, offer.plan.epoch, why
            )

    def _verify(self, signer: PeerId, message: bytes, signature: bytes) -> bool:
        """Whether ``signer``'s identity key (in its peer id) signed ``message``."""
        key = (signer, signature.hex(), message)
        if key not in self._verified:
            if len(self._verified) >= MAX_VERIFIED:
                self._verified.clear()
            self._verified[key] = verify_signature(signer, message, signature)
        return self._verified[key]


def verify_signature(signer: PeerId, message: bytes, signature: bytes) -> bool:
    """Whether the key embedded in peer id ``signer`` signed ``message`` (False for a
    malformed id, a key that is not embedded, or a bad signature)."""
    from libp2p.peer.id import ID

    try:
        public = ID.from_base58(signer).extract_public_key()
        return public is not None and bool(public.verify(message, signature))
    except Exception:  # any malformed id, key or signature is simply not a valid one
        return False


__all__ = [
    "COMPACT_HINT",
    "HOST_KEY",
    "MAX_HOST_CHARS",
    "MAX_VERIFIED",
    "REFUSAL_LOG_INTERVAL_S",
    "Followed",
    "PlanFollower",
    "loopback_floors",
    "record_host",
    "snapshot",
    "unheld",
    "verify_signature",
]
