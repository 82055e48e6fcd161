"""The dashboard's live feed: the node's view once a second, discrete events, short history.

```
Feed.run()                         a task of the API's nursery, ticking every interval_s
├── view_events(before, after)     pure: peer joined/suspect/dead/left, plan adopted,
│                                  stage loaded, recovery (a diff of two status views)
├── Series                         bounded ring of samples: tokens/s, TTFT, TPOT
└── subscribers                    one bounded memory channel per SSE client
```

Every message is encoded once per tick and offered to each subscriber with
``send_nowait``: a client too slow to drain its small buffer is disconnected
(its channel closed; the page reconnects and gets a fresh ``hello``), so no
client can make the node hold more than ``queue`` messages for it. The
recent events and samples are kept in bounded deques too.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from hetmesh.errors import Rejected
from hetmesh.node.peer_view import PeerView, ready_stages_in_view
from hetmesh.scheduler.announcement import ServingAnnouncement, parse_plan, read_serving
from hetmesh.scheduler.records import Plan
from hetmesh.scheduler.replan import newest

log = logging.getLogger(__name__)


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"…{peer_id[-8:]}"


def _health(view: Mapping[str, Any]) -> dict[str, str]:
    return {str(p.get("peer_id")): str(p.get("health", "?")) for p in view.get("peers") or ()}


def _serving(peer: Mapping[str, Any]) -> ServingAnnouncement:
    record = peer.get("record") or {}
    return read_serving(record.get("extra"), record.get("stages") or (), plan_of=None)


def _gateway_sum(view: Mapping[str, Any], name: str) -> dict[str, int]:
    return {
        str(p.get("peer_id")): int(_serving(p).gateway.get(name, 0))
        for p in view.get("peers") or ()
    }


def newest_plan(view: Mapping[str, Any]) -> dict[str, Any] | None:
    """The newest plan the view's peers follow, as its wire map; None if none."""
    return PlanCache().newest(view)


class PlanCache:
    """:func:`newest_plan` that parses each distinct plan once (a parse costs milliseconds,
    and the feed meets the same plan in every peer's record, every tick)."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        # a plan's canonical JSON -> (Plan, its wire map), or None if malformed
        self._parsed: dict[str, tuple[Plan, dict[str, Any]] | None] = {}

    def newest(self, view: Mapping[str, Any]) -> dict[str, Any] | None:
        best = PeerView.of_status(view, plan_of=self._parse).newest_plan()
        if best is None:
            return None
        for entry in self._parsed.values():
            if entry is not None and entry[0] is best:
                return entry[1]
        return best.to_wire()

    def by_model(self, view: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The newest plan of each model the view's live peers serve, as wire maps (a
        mesh serving several models follows one plan per model)."""
        mesh = PeerView.of_status(view, plan_of=self._parse)
        out: dict[str, dict[str, Any]] = {}
        for name in sorted({p.serving.model for p in mesh.peers if p.serving.model}):
            members = PeerView.of(name, mesh.peers).members
            plans = [m.serving.plan for m in members if m.serving.plan is not None]
            best = newest(p for p in plans if p.model_name == name)
            if best is not None:
                out[name] = self._wire(best)
        return out

    def _wire(self, plan: Plan) -> dict[str, Any]:
        for entry in self._parsed.values():
            if entry is not None and entry[0] is plan:
                return entry[1]
        return plan.to_wire()

    def _parse(self, raw: Mapping[str, object]) -> Plan | None:
        key = json.dumps(raw, sort_keys=True, default=str)
        if key not in self._parsed:
            if len(self._parsed) >= self.size:
                self._parsed.clear()
            plan = parse_plan(raw)  # what other nodes announced: a bad one reads as none
            self._parsed[key] = None if plan is None else (plan, plan.to_wire())
        entry = self._parsed[key]
        return None if entry is None else entry[0]


def _event(kind: str, level: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "level": level, "message": message, **fields}


def view_events(
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any],
    plan_of: Callable[[Mapping[str, Any]], dict[str, Any] | None] = newest_plan,
) -> list[dict[str, Any]]:
    """What changed between two status views of one node, as event records (pure).

    The first view (``before`` None) yields no events: the page shows it as state.
    ``plan_of`` picks a view's newest plan (a :class:`PlanCache`'s ``newest`` is faster).
    """
    if before is None:
        return []
    out: list[dict[str, Any]] = []
    old, new = _health(before), _health(after)
    for pid, health in sorted(new.items()):
        was = old.get(pid)
        if was == health or health == "self":
            continue
        if was is None or (was in ("dead", "left") and health in ("alive", "joining")):
            out.append(_event("joined", "info", f"peer {_short(pid)} joined", peer_id=pid))
        elif health == "alive":
            msg = f"peer {_short(pid)} is alive again (was {was})"
            out.append(_event("alive", "info", msg, peer_id=pid))
        elif health in ("suspect", "dead", "left"):
            level = "warn" if health == "suspect" else "error" if health == "dead" else "info"
            msg = f"peer {_short(pid)} is {health} (was {was})"
            out.append(_event(health, level, msg, peer_id=pid))
    for pid in sorted(set(old) - set(new)):
        out.append(_event("left", "info", f"peer {_short(pid)} was forgotten", peer_id=pid))
    plan_before, plan_after = plan_of(before), plan_of(after)
    if plan_after is not None and (
        plan_before is None or plan_before.get("epoch") != plan_after.get("epoch")
    ):
        pipes = plan_after.get("pipelines") or []
        stages = len((pipes[0].get("stages") or []) if pipes else [])
        out.append(
            _event(
                "plan",
                "info",
                f"epoch {plan_after.get('epoch')} adopted ({plan_after.get('strategy')}, "
                f"{stages} stage(s), {len(pipes)} pipeline(s))",
                epoch=plan_after.get("epoch"),
                strategy=plan_after.get("strategy"),
            )
        )
    for pid, start, end in sorted(ready_stages_in_view(after) - ready_stages_in_view(before)):
        msg = f"units [{start}, {end}) loaded on {_short(pid)}"
        out.append(_event("stage", "info", msg, peer_id=pid, start=start, end=end))
    recovered_before = _gateway_sum(before, "recoveries")
    for pid, count in sorted(_gateway_sum(after, "recoveries").items()):
        gained = count - recovered_before.get(pid, count)
        if gained > 0:
            msg = f"{gained} session(s) recovered by gateway {_short(pid)} (re-routed, replayed)"
            out.append(_event("recovery", "warn", msg, peer_id=pid, sessions=gained))
    return out


@dataclass(slots=True)
class _Window:
    """TTFT and TPOT observed since the last sample."""

    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    tpot_sum_s: float = 0.0
    tpot_count: int = 0


class Series:
    """A bounded ring of once-a-tick samples: mesh tokens/s, this node's TTFT and TPOT."""

    def __init__(self, length: int = 300) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=length)
        self._window = _Window()
        self._tokens: dict[str, int] | None = None
        self._at_s: float | None = None

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        w = self._window
        if ttft_s is not None:
            w.ttft_sum_s += ttft_s
            w.ttft_count += 1
        if tpot_s is not None:
            w.tpot_sum_s += tpot_s
            w.tpot_count += 1

    def sample(self, view: Mapping[str, Any], at_s: float) -> dict[str, Any]:
        """Close the current window: tokens/s from the peers' gateway counters."""
        tokens = _gateway_sum(view, "tokens_out")
        rate: float | None = None
        if self._tokens is not None and self._at_s is not None and at_s > self._at_s:
            # per peer, never negative: a restarted peer's counter starts again at 0
            gained = sum(max(0, n - self._tokens.get(pid, n)) for pid, n in tokens.items())
            rate = gained / (at_s - self._at_s)
        w = self._window
        point = {
            "at_s": round(at_s, 3),
            "tokens_per_s": rate,
            "ttft_s": w.ttft_sum_s / w.ttft_count if w.ttft_count else None,
            "tpot_s": w.tpot_sum_s / w.tpot_count if w.tpot_count else None,
        }
        self.samples.append(point)
        self._window = _Window()
        self._tokens, self._at_s = tokens, at_s
        return point


def sse(kind: str, data: Any) -> str:
    """One server-sent event."""
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"


class Feed:
    """The live feed behind ``/v1/hetmesh/events``; :meth:`run` ticks it."""

    def __init__(
        self,
        view: Callable[[], dict[str, Any]],
        *,
        interval_s: float = 1.0,
        history: int = 300,
        backlog: int = 200,
        queue: int = 8,
        max_clients: int = 32,
    ) -> None:
        self._view = view
        self.interval_s = interval_s
        self.series = Series(history)
        self.events: deque[dict[str, Any]] = deque(maxlen=backlog)
        self.queue = queue
        self.max_clients = max_clients
        self.dropped_clients = 0
        self._ids = itertools.count(1)
        self.feed_id = secrets.token_hex(8)  # event ids restart with the node: tells the page
        self._clients: set[trio.MemorySendChannel[str]] = set()
        self._last_view: dict[str, Any] | None = None
        self._plans = PlanCache()
        self._snapshot: dict[str, Any] | None = None

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """Record one finished API request's TTFT and TPOT (None: not measured)."""
        self.series.observe(ttft_s, tpot_s)

    def tick(self, now_s: float | None = None) -> None:
        """Read the view, derive events and a sample, and push them to every client."""
        now_s = time.time() if now_s is None else now_s
        view = json.loads(json.dumps(self._view(), default=str))  # plain JSON data
        events = view_events(self._last_view, view, self._plans.newest)
        self._last_view = view
        for event in events:
            event |= {"id": next(self._ids), "at_s": round(now_s, 3)}
            self.events.append(event)
            self._broadcast(sse("mesh-event", event))
        self._snapshot = {
            "view": view,
            "plan": self._plans.newest(view),
            "plans": self._plans.by_model(view),  # one per model the mesh serves
            "sample": self.series.sample(view, now_s),
        }
        self._broadcast(sse("snapshot", self._snapshot))

    def hello(self) -> str:
        """The first message of a stream: recent events, the series, the latest snapshot."""
        body = {
            "events": list(self.events),
            "series": list(self.series.samples),
            "snapshot": self._snapshot,
            "interval_s": self.interval_s,
            "feed_id": self.feed_id,
        }
        return sse("hello", body)

    def _broadcast(self, message: str) -> None:
        for send in list(self._clients):
            try:
                send.send_nowait(message)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                # too slow (or gone): drop it rather than buffer without bound
                self._clients.discard(send)
                send.close()
                self.dropped_clients += 1

    def subscribe(self) -> _Subscription:
        """A new client's channel (a context manager: leaving it unsubscribes).

        Raises :class:`~hetmesh.errors.Rejected` when ``max_clients`` are connected.
        """
        if len(self._clients) >= self.max_clients:
            raise Rejected(f"busy: {self.max_clients} dashboard clients are connected")
        send, receive = trio.open_memory_channel[str](self.queue)
        self._clients.add(send)
        return _Subscription(self, send, receive)

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def run(self) -> None:
        """Tick every ``interval_s``; never returns. A failed tick is logged, not fatal."""
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("the dashboard feed could not read the node's view")
            await trio.sleep(self.interval_s)


class _Subscription:
    def __init__(
        self,
        feed: Feed,
        send: trio.MemorySendChannel[str],
        receive: trio.MemoryReceiveChannel[str],
    ) -> None:
        self.feed = feed
        self.send = send
        self.receive = receive

    def __enter__(self) -> trio.MemoryReceiveChannel[str]:
        return self.receive

    def __exit__(self, *exc: object) -> None:
        self.feed._clients.discard(self.send)
        self.send.close()
        self.receive.close()


__all__ = ["Feed", "PlanCache", "Series", "newest_plan", "sse", "view_events"]
