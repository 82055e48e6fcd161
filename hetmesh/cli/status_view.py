"""The plan and load parts of ``hetmesh status`` (pure: a view in, records and tables out).

:func:`summarize` reads a node's status view (``Discovery.view()``): the newest
plan any peer follows (``extra["plan"]``), stage readiness (``stages``), each
peer's load (``load``), its weight format (``extra["weights"]``) and gateway
counters (``extra["gateway"]``). Given the previous view and the seconds
between them it also derives tokens/s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from hetmesh.node.peer_view import (
    ALIVE,
    PeerView,
    ready_pipelines_in_view,
    ready_stages_in_view,
)
from hetmesh.node.readiness import ready_pipelines
from hetmesh.scheduler.announcement import ServingAnnouncement, parse_plan, read_serving


def _newest_plan(view: Mapping[str, Any]) -> dict[str, Any] | None:
    plan = PeerView.of_status(view, plan_of=parse_plan).newest_plan()
    return None if plan is None else plan.to_wire()


def _records(view: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        str(p.get("peer_id")): dict(p.get("record") or {}, health=p.get("health", "?"))
        for p in view.get("peers") or ()
    }


def _serving(record: Mapping[str, Any]) -> ServingAnnouncement:
    """What a peer's record announces of its serving state (plan not parsed)."""
    return read_serving(record.get("extra"), record.get("stages") or (), plan_of=None)


def _weights(record: Mapping[str, Any]) -> str:
    """The weight format a peer announced it serves in ("" if none)."""
    return _serving(record).weights


def _tokens_out(record: Mapping[str, Any]) -> int:
    return int(_serving(record).gateway.get("tokens_out", 0))


def _speculation(record: Mapping[str, Any]) -> dict[str, float] | None:
    """A gateway's speculative decoding (issue 48): drafts sent, drafts kept, and tokens
    per verify step; None where it sent none."""
    counters = _serving(record).gateway
    number = partial(_number, counters)
    steps, drafted = int(number("verify_steps")), int(number("drafted"))
    if steps <= 0 or drafted <= 0:
        return None
    return {
        "drafted": drafted,
        "accepted": int(number("accepted")),
        "tokens_per_step": number("verified_tokens") / steps,
    }


def _fetch(counters: Mapping[str, float]) -> dict[str, float] | None:
    """A peer's fetch in progress (bytes done / total, rate), None when it fetches nothing."""
    if not counters.get("fetching"):
        return None
    return {
        "done_bytes": counters.get("fetch_done_bytes", 0.0),
        "total_bytes": counters.get("fetch_total_bytes", 0.0),
        "rate_bps": counters.get("fetch_rate_bps", 0.0),
    }


def _held_text(runs: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in runs) or "-"


def _fetch_text(fetch: Mapping[str, float] | None) -> str:
    if not fetch:
        return "-"
    return (
        f"{fetch['done_bytes'] / 2**20:.0f}/{fetch['total_bytes'] / 2**20:.0f} MiB"
        f" at {fetch['rate_bps'] / 2**20:.1f} MiB/s"
    )


def _plan_summary(
    raw: Mapping[str, Any] | None,
    records: Mapping[str, Mapping[str, Any]],
    ready_stages: set[tuple[str, int, int]],
    ready_pipelines: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """A plan's wire map as ``status`` shows it: each stage's peer, device, weights,
    step times and readiness (what is ready is the peer view's to say, as the node's
    router sees it)."""
    if raw is None:
        return None
    pipelines = []
    for pipe in raw.get("pipelines") or ():
        stages = []
        for s in pipe.get("stages") or ():
            pid = str(s.get("peer_id"))
            record = records.get(pid, {})
            recent = [float(x) for x in (record.get("load") or {}).get("recent_step_s") or ()]
            stages.append(
                {
                    "peer_id": pid,
                    "device": s.get("device", "?"),
                    "weights": str(s.get("weights") or _weights(record) or "?"),
                    "start": int(s.get("start", 0)),
                    "end": int(s.get("end", 0)),
                    "predicted_step_s": float(s.get("decode_step_s", 0.0)),
                    "measured_step_s": statistics.median(recent) if recent else None,
                    "ready": (pid, s.get("start"), s.get("end")) in ready_stages,
                    "health": record.get("health", "unknown"),
                    "bottleneck": False,
                }
            )
        if stages:
            slowest = max(
                stages,
                key=lambda st: (
                    st["measured_step_s"]
                    if st["measured_step_s"] is not None
                    else st["predicted_step_s"]
                ),
            )
            slowest["bottleneck"] = True
        pipelines.append(
            {
                "stages": stages,
                "predicted_latency_s": float(pipe.get("decode_latency_s", 0.0)),
                "predicted_tokens_per_s": float(pipe.get("throughput_tps", 0.0)),
                "ready": pipe in ready_pipelines,
            }
        )
    return {
        "epoch": int(raw.get("epoch", -1)),
        "model": raw.get("model_name", "?"),
        "strategy": raw.get("strategy", "?"),
        "objective": raw.get("objective", "?"),
        "predicted_latency_s": float(raw.get("decode_latency_s", 0.0)),
        "predicted_tokens_per_s": float(raw.get("throughput_tps", 0.0)),
        "pipelines": pipelines,
    }


def _models(
    view: Mapping[str, Any],
    records: Mapping[str, Mapping[str, Any]],
    peers: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One entry per model the live peers serve: its newest plan (as
    :func:`_plan_summary` shows it), why it cannot be placed, and its load (the
    sessions, queue, tokens out and tokens/s of the peers serving it)."""
    from hetmesh.scheduler.replan import newest

    mesh = PeerView.of_status(view, plan_of=parse_plan)
    names = sorted({p.serving.model for p in mesh.peers if p.serving.model})
    out = []
    for name in names:
        members = PeerView.of(name, mesh.peers)
        served = [m.serving for m in members.members]
        plan = newest(s.plan for s in served if s.plan is not None and s.plan.model_name == name)
        ready = members.ready_stages()
        rows = [p for p in peers if p["model"] == name]
        rates = [p["tokens_per_s"] for p in rows if p["tokens_per_s"] is not None]
        out.append(
            {
                "model": name,
                "plan": _plan_summary(
                    None if plan is None else plan.to_wire(),
                    records,
                    ready,
                    [p.to_wire() for p in ready_pipelines(plan, ready)],
                ),
                "insufficient": members.insufficient(),
                "peers": [p["peer_id"] for p in rows],
                "sessions": sum(p["sessions"] for p in rows),
                "queue": sum(p["queue"] for p in rows),
                "tokens_out": sum(p["tokens_out"] for p in rows),
                "tokens_per_s": sum(rates) if rates else None,
            }
        )
    return out


def summarize(
    view: Mapping[str, Any],
    previous: Mapping[str, Any] | None = None,
    interval_s: float | None = None,
) -> dict[str, Any]:
    """``{"plan": ..., "load": ...}`` for a view (plain data, JSON-ready)."""
    records = _records(view)
    raw = _newest_plan(view)
    ready_stages = ready_stages_in_view(view)
    ready_pipelines = [p.to_wire() for p in ready_pipelines_in_view(view)]
    plan = _plan_summary(raw, records, ready_stages, ready_pipelines)
    before = _records(previous) if previous is not None else {}
    peers = []
    for pid, record in records.items():
        load = record.get("load") or {}
        rate = None
        if interval_s and pid in before:
            rate = max(0, _tokens_out(record) - _tokens_out(before[pid])) / interval_s
        peers.append(
            {
                "peer_id": pid,
                "model": _serving(record).model or "-",
                "weights": _weights(record) or "-",
                "sessions": int(load.get("active_sessions", 0) or 0),
                "queue": int(load.get("queue_depth", 0) or 0),
                "kv_bytes_used": int(load.get("kv_bytes_used", 0) or 0),
                "tokens_out": _tokens_out(record),
                "tokens_per_s": rate,
                "units_held": [list(r) for r in _serving(record).units_held],
                "fetch": _fetch(_serving(record).shards),
                "speculation": _speculation(record),
            }
        )
    rates = [p["tokens_per_s"] for p in peers if p["tokens_per_s"] is not None]
    # why the model cannot be placed (e.g. units no live peer holds), as its peers announce
    verdicts = sorted({_serving(r).insufficient for r in records.values()} - {""})
    return {
        "insufficient": verdicts[0] if verdicts else "",
        "plan": plan,
        "models": _models(view, records, peers),
        "kv": _kv_rows(records),
        "load": {
            "peers": peers,
            "sessions": sum(p["sessions"] for p in peers),
            "queue": sum(p["queue"] for p in peers),
            "tokens_per_s": sum(rates) if rates else None,
        },
    }


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"…{peer_id[-8:]}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def plan_table(summary: Mapping[str, Any]) -> Table | Text | Group:
    """The plan: pipelines and stages, predicted against measured step times; on a
    mesh serving several models, one plan per model with the model's load."""
    models = summary.get("models") or []
    if len(models) > 1:
        return Group(*(_plan_table(m["plan"], m["insufficient"], _model_load(m)) for m in models))
    return _plan_table(summary.get("plan"), summary.get("insufficient") or "")


def _model_load(model: Mapping[str, Any]) -> str:
    return (
        f"{model['model']}: {len(model['peers'])} peer(s), {model['sessions']} session(s), "
        f"queue {model['queue']}, {_rate(model['tokens_per_s'])} tokens/s"
    )


def _plan_table(plan: Mapping[str, Any] | None, why: str, load: str = "") -> Table | Text:
    if not plan:
        text = f"no plan: {why}" if why else "no plan published yet"
        return Text(f"{load}: {text}" if load else text)
    table = Table(
        title=(
            f"plan epoch {plan['epoch']} ({plan['strategy']}, {plan['objective']}) for "
            f"{plan['model']}: predicted {_ms(plan['predicted_latency_s'])}/token, "
            f"{plan['predicted_tokens_per_s']:.1f} tokens/s"
        ),
        caption=load or None,
    )
    for col in (
        "pipeline",
        "stage",
        "peer",
        "device",
        "weights",
        "units",
        "predicted step",
        "measured step",
        "state",
    ):
        table.add_column(col)
    for i, pipe in enumerate(plan["pipelines"]):
        for j, st in enumerate(pipe["stages"]):
            # not ready: loading on a live peer, out of the routes on any other
            waiting = "loading" if st["health"] in ALIVE else "unreachable"
            state = ("ready" if st["ready"] else waiting) + f", {st['health']}"
            style = None
            if st["bottleneck"]:
                state += "  ◀ bottleneck"
                style = "bold red"
            table.add_row(
                str(i) if j == 0 else "",
                str(j),
                _short(st["peer_id"]),
                str(st["device"]),
                str(st["weights"]),
                f"[{st['start']}, {st['end']})",
                _ms(st["predicted_step_s"]),
                _ms(st["measured_step_s"]),
                state,
                style=style,
            )
    return table


def _kv_rows(records: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per stage server: its KV pool's blocks, prefix hits, preemptions, migrations."""
    rows = []
    for pid, record in records.items():
        for stage in _serving(record).stage_servers:
            number = partial(_number, stage)
            rows.append(
                {
                    "peer_id": pid,
                    "start": int(number("start")),
                    "end": int(number("end")),
                    "blocks_in_use": int(number("kv_blocks_in_use")),
                    "blocks_free": int(number("kv_blocks_free")),
                    "blocks_cached": int(number("kv_blocks_cached")),
                    "prefix_hit_rate": number("kv_prefix_hit_rate"),
                    "preempted": int(number("kv_preempted")),
                    "migrations": int(number("kv_migrations")),
                    "migrated_bytes": int(number("kv_migrated_bytes")),
                    "waiting": int(number("kv_waiting")),
                }
            )
    return sorted(rows, key=lambda r: (r["start"], r["peer_id"]))


def _number(entry: Mapping[str, object], key: str) -> float:
    """``entry[key]`` if a number (what another peer announces may be anything), else 0."""
    value = entry.get(key, 0)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def kv_table(summary: Mapping[str, Any]) -> Table:
    """KV per stage: blocks in use / free / cached, prefix-cache hit rate, preemptions,
    migrations in (and their bytes), sessions waiting for admission."""
    table = Table(title="KV cache per stage (16-token blocks; cached blocks count free)")
    columns = (
        "peer",
        "units",
        "in use",
        "free",
        "cached",
        "prefix hits",
        "preempted",
        "migrated",
        "waiting",
    )
    for col in columns:
        table.add_column(col)
    for r in summary.get("kv") or ():
        table.add_row(
            _short(r["peer_id"]),
            f"[{r['start']}, {r['end']})",
            str(r["blocks_in_use"]),
            str(r["blocks_free"]),
            str(r["blocks_cached"]),
            f"{100 * r['prefix_hit_rate']:.0f} %",
            str(r["preempted"]),
            f"{r['migrations']} ({r['migrated_bytes'] / 2**20:.1f} MiB)",
            str(r["waiting"]),
        )
    return table


def load_table(summary: Mapping[str, Any]) -> Table:
    """Load per peer: sessions, queue, KV in use, tokens out and tokens/s."""
    load = summary.get("load") or {}
    table = Table(
        title=(
            f"load: {load.get('sessions', 0)} sessions, queue {load.get('queue', 0)}, "
            f"{_rate(load.get('tokens_per_s'))} tokens/s"
        )
    )
    several = len(summary.get("models") or ()) > 1  # then each peer's model too
    columns = ("peer", "weights", "units on disk", "fetching", "sessions", "queue", "KV used")
    tail = ("tokens out", "tokens/s", "drafts kept", *(("model",) if several else ()))
    for col in (*columns, *tail):
        table.add_column(col)
    for p in load.get("peers") or ():
        table.add_row(
            _short(p["peer_id"]),
            str(p.get("weights", "-")),
            _held_text(p.get("units_held") or ()),
            _fetch_text(p.get("fetch")),
            str(p["sessions"]),
            str(p["queue"]),
            _mib(p["kv_bytes_used"]),
            str(p["tokens_out"]),
            _rate(p["tokens_per_s"]),
            _speculation_text(p.get("speculation")),
            *((str(p.get("model", "-")),) if several else ()),
        )
    return table


def _speculation_text(spec: Mapping[str, float] | None) -> str:
    if not spec:
        return "-"
    kept = f"{int(spec['accepted'])}/{int(spec['drafted'])}"
    return f"{kept}, {spec['tokens_per_step']:.2f} tok/step"


__all__ = ["kv_table", "load_table", "plan_table", "summarize"]
