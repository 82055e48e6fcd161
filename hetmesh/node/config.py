"""A node's configuration: flags over environment over a TOML file over defaults.

``hetmesh node start --config node.toml`` reads a TOML file whose keys are the
command's long flags (dashes or underscores), e.g.::

    model = "smollm2-135m-instruct"
    bootstrap = ["/ip4/10.0.0.2/tcp/4001/p2p/12D3Koo..."]
    max-memory = "8GiB"
    plan-strategy = "hetmesh"
    weights = "int8"

Typer already gives a flag precedence over its environment variable; this
module fills in what neither set from the file, then from the defaults.
Unknown keys and ill-typed values are refused with a clear message.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hetmesh.errors import InvalidRequest

if TYPE_CHECKING:
    from hetmesh.node.gateway import GatewayTimeouts

PlanStrategy = Literal["hetmesh", "even", "memory-proportional", "greedy"]
PLAN_STRATEGIES: tuple[str, ...] = ("hetmesh", "even", "memory-proportional", "greedy")
# full-context sessions the planner budgets KV memory for on each stage when
# --max-sessions is not given; the stage then admits by KV blocks alone
PLANNED_SESSIONS = 8
STOP_DRAIN_S = 10.0
# the most drafts a decode step carries where the measured budget chooses (issue 48)
DEFAULT_SPECULATIVE_K = 8


def _default_timeouts() -> GatewayTimeouts:
    from hetmesh.node.gateway import GatewayTimeouts

    return GatewayTimeouts()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingConfig:
    """What and how a node serves (the model part of ``hetmesh node start``)."""

    model: str | None = None  # None: the default model
    # a weight format; "native": the checkpoint's own (int4 for the default model's
    # Q4_1); "auto": the fastest that fits, measured
    weights: str = "native"
    cache_dir: Path | None = None
    objective: Literal["latency", "throughput"] = "latency"
    plan_strategy: PlanStrategy = "hetmesh"
    max_context_tokens: int = 2048
    # a hard cap on concurrent sessions per stage, and the sessions the planner budgets
    # KV for; None: the planner budgets PLANNED_SESSIONS and stages admit by blocks alone
    max_sessions: int | None = None
    reserve_bytes: int = 64 << 20
    threads: int = 1  # torch intra-op threads of this node
    block_step_s: float | None = None  # announce this instead of calibrating (None: measure)
    gil_switch_interval_s: float = 0.0005
    standby: bool = True  # spare devices (or one freed at ≤10% latency) back a stage up
    settle_s: float = 3.0  # the coordinator's first plan waits for peers this long
    plan_interval_s: float = 1.0
    idle_session_s: float = 300.0
    # each stage's KV pool in tokens; None: the KV memory the planner budgets for the stage
    kv_pool_tokens: int | None = None
    prefix_cache: bool = True  # stages share the KV blocks of common prompt prefixes
    # a session whose stage leaves alive (re-plan, drain) moves with its KV (False: replay)
    migrate: bool = True
    # drafts a decode step of a request entering here carries (speculative decoding,
    # issue 48: drafts verified by the last stage); 0: none. With speculative_measured
    # the most a step carries (the measured budget chooses, 0 where drafts do not pay),
    # else every step's count. On by default: prompt lookup, the measured budget
    speculative_k: int = DEFAULT_SPECULATIVE_K
    speculative_measured: bool = True
    # what drafts: "lookup" (prompt lookup), or a weight format ("int4"): a copy of the
    # served model in it at this node (hetmesh.speculative.draft_model)
    draft: str = "lookup"
    # a stopping node waits up to this long for its sessions to move away (0: it leaves at
    # once and they replay); nodes started by the CLI wait STOP_DRAIN_S (SIGTERM drains)
    drain_s: float = 0.0
    # admit the old way (prompt + max tokens reserved up front): for bench/kv.py only
    kv_reserve_whole: bool = False
    route_wait_s: float = 30.0  # a request waits this long for a serving pipeline
    backends: tuple[str, ...] = ("shm", "torchdist", "tcp", "libp2p")
    require_encryption: bool = False
    tcp_host: str | None = None  # None: the address the node's libp2p host is reached at
    # the gateway (and torch with it) loads only when a serving config is built
    timeouts: GatewayTimeouts = field(default_factory=lambda: _default_timeouts())


# flag name -> (type, allowed values or None)
_KEYS: dict[str, tuple[type | tuple[type, ...], tuple[str, ...] | None]] = {
    "listen": (list, None),
    "bootstrap": (list, None),
    "mesh_secret": (str, None),
    "mesh_secret_file": (str, None),
    "no_mdns": (bool, None),
    "data_dir": (str, None),
    "max_memory": ((str, int), None),
    "device": (str, None),
    "model": ((str, list), None),  # several: one member each (hetmesh.node.models)
    "model_memory": (list, None),
    "min_replicas": (list, None),  # NAME=N members of a model (hetmesh.node.models)
    "weights": (str, None),  # checked against the device by hetmesh.node.weights
    "cache_dir": (str, None),
    "objective": (str, ("latency", "throughput")),
    "plan_strategy": (str, PLAN_STRATEGIES),
    "max_context": (int, None),
    "max_sessions": (int, None),
    "kv_pool_tokens": (int, None),
    "prefix_cache": (bool, None),
    "migrate": (bool, None),
    "speculative": (bool, None),
    "speculative_k": (int, None),
    "draft": (str, None),  # "lookup" or a weight format, checked by hetmesh.cli.node
    "kv_reserve_whole": (bool, None),
    "threads": (int, None),
    "block_step_ms": ((int, float), None),
    "serve": (bool, None),
    "relay": (bool, None),
    "require_encryption": (bool, None),
    "backends": (list, None),
    "verbose": (bool, None),
    "api_port": (int, None),
    "api_host": (str, None),
    "api_key": (str, None),
}


def load_config_file(path: Path) -> dict[str, Any]:
    """The settings of a TOML config file, keys normalised to flag names."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"config file {path} is not valid TOML: {exc}") from exc
    return check_settings(raw, source=str(path))


def check_settings(raw: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _KEYS:
            known = ", ".join(sorted(k.replace("_", "-") for k in _KEYS))
            raise InvalidRequest(f"{source}: unknown setting {key!r}; known: {known}")
        kind, allowed = _KEYS[name]
        if (isinstance(value, bool) and kind is int) or not isinstance(value, kind):
            raise InvalidRequest(f"{source}: {key} has the wrong type ({type(value).__name__})")
        if allowed is not None and value not in allowed:
            raise InvalidRequest(f"{source}: {key} must be one of {', '.join(allowed)}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise InvalidRequest(f"{source}: {key} must be a list of strings")
        out[name] = value
    return out


def merge(flags: Mapping[str, Any], file: Mapping[str, Any]) -> dict[str, Any]:
    """Flags (already merged with the environment by typer) over the file's settings."""
    merged = dict(file)
    for key, value in flags.items():
        if value is not None:
            merged[key] = value
    return merged


def default_threads() -> int:
    """Torch threads of a node not told otherwise: the whole cores it may use (its
    cgroup's CPU quota and its affinity included), at least one.

    A node on its own machine decodes faster with them (2 threads against one:
    fp32 1.65x, int4 1.37x, docs/benchmarks.md); several nodes on one host are
    started with their share (:func:`hetmesh.testbed.local_mesh.share_threads`).
    """
    import psutil

    from hetmesh.discovery.profiling import effective_cores, read_cgroup_limits

    logical = psutil.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    cores = effective_cores(logical, read_cgroup_limits())
    return max(1, int(min(cores, physical)))


__all__ = [
    "PLANNED_SESSIONS",
    "PLAN_STRATEGIES",
    "PlanStrategy",
    "ServingConfig",
    "check_settings",
    "default_threads",
    "load_config_file",
    "merge",
]
