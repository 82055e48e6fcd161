"""The gateway's records: its step timeouts, its statistics and its counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayTimeouts:
    """Step timeouts: ``factor`` × the recent step time, never below the floors."""

    factor: float = 4.0
    step_floor_s: float = 4.0
    prefill_floor_s: float = 30.0
    prefill_per_token_s: float = 0.01
    admission_s: float = 30.0  # how long a request waits for a busy mesh
    resume_s: float = 300.0  # how long a preempted session, mid-stream, waits to be readmitted
    ping_s: float = 1.5
    close_s: float = 5.0
    replan_pause_s: float = 0.5
    max_extensions: int = 3  # a slow step whose stages all answer pings may wait this often
    max_recoveries: int = 8
    max_preemptions: int = 64  # resumes after a stage evicted the session's KV to make room


@dataclass(frozen=True, slots=True)
class GatewayStatistics:
    sessions_started: int
    sessions_finished: int
    sessions_failed: int
    active_sessions: int
    recoveries: int
    tokens_out: int
    stale_frames: int
    rejected_busy: int
    slow_steps: int
    preemptions: int = 0
    prefix_tokens_skipped: int = 0  # prompt tokens not prefilled: cached on every stage
    # recoveries started by a death (peer_gone) before the step timed out, and the
    # seconds of step timeout they did not wait for, in all
    early_recoveries: int = 0
    early_recovery_s: float = 0.0
    foreign_frames: int = 0  # frames for a session from a peer not on its route
    migrations: int = 0  # sessions moved to a new route with their KV (no replay)
    migration_fallbacks: int = 0  # moves that failed: those sessions were replayed
    move_replays: int = 0  # sessions moved by replay because migration is off
    split_prefills: int = 0  # prompts prefilled by their stage and an idle helper together
    # speculative decoding (issue 48): steps that carried drafts, the drafts they
    # carried, those the last stage kept, and the tokens those steps brought
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0
    # the gateway's turn, a decode token in (its link's reader, or this node's last
    # stage) to the next step written to another node's first stage: by the lane (on
    # the reader thread) and by trio (the session's task), how many and their seconds
    # in all (a step for this node's own first stage is its forward: not counted)
    lane_turns: int = 0
    lane_turn_s: float = 0.0
    trio_turns: int = 0
    trio_turn_s: float = 0.0


@dataclass(slots=True)
class Counters:
    """The gateway's counters, one record: :class:`GatewayStatistics` less what is
    read off the sessions running now."""

    sessions_started: int = 0
    sessions_finished: int = 0
    sessions_failed: int = 0
    recoveries: int = 0
    tokens_out: int = 0
    stale_frames: int = 0
    rejected_busy: int = 0
    slow_steps: int = 0
    preemptions: int = 0
    prefix_tokens_skipped: int = 0
    early_recoveries: int = 0
    early_recovery_s: float = 0.0
    foreign_frames: int = 0
    migrations: int = 0
    migration_fallbacks: int = 0
    move_replays: int = 0
    split_prefills: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0
    trio_turns: int = 0
    trio_turn_s: float = 0.0
