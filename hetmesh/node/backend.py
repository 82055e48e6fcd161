"""The running node behind the HTTP API: :class:`NodeBackend` implements
:class:`hetmesh.node.api.Backend` over the node's discovery and serving.

The daemon builds it and hands it to :func:`hetmesh.node.api_serve.serve_api`, so the
API never imports the daemon or the serving code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import trio

from hetmesh import errors
from hetmesh.node.api_forward import API_KEY, api_entry, api_targets
from hetmesh.node.api_metrics import MeshGauges
from hetmesh.node.memory import MEMORY_KEY
from hetmesh.protocol.generate import GenerateRequest, SamplingParams
from hetmesh.scheduler.announcement import read_serving

if TYPE_CHECKING:
    from hetmesh.discovery.service import Discovery
    from hetmesh.node.serving import Serving


class NodeBackend:
    """A node's :class:`~hetmesh.node.serving.Serving` (None: started with --no-serve)."""

    def __init__(self, discovery: Discovery, serving: Serving | None) -> None:
        self.discovery = discovery
        self.serving = serving

    def _serving(self) -> Serving:
        serving = self.serving
        if serving is None or serving.gateway is None:
            raise errors.NoRoute("this node does not serve a model (started with --no-serve?)")
        return serving

    def models(self) -> list[str]:
        return [self.serving.model_key] if self.serving is not None else []

    def for_model(self, model: str) -> NodeBackend:
        """The backend serving ``model``: this one (the API checked the name)."""
        return self

    def remote_apis(self) -> dict[str, list[str]]:
        """Model -> the APIs of the live peers serving it (:mod:`hetmesh.node.api_forward`)."""
        return api_targets(
            (read_serving(e.record.extra, (), plan_of=None).model, e.record.extra, e.addrs)
            for e in self.discovery.alive()
            if e.record is not None
        )

    def announce_api(self, host: str, port: int) -> None:
        """Tell the mesh where this node's API listens (peers forward requests here)."""
        self.discovery.set_extra(API_KEY, api_entry(host, port))

    def max_context(self) -> int:
        return int(self._serving().constraints.max_context_tokens)

    def ready(self) -> bool:
        return self.serving is not None and self.serving.ready()

    async def encode(self, request: GenerateRequest) -> list[int]:
        return await trio.to_thread.run_sync(self._serving().encode, request)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        return self._serving().stream(prompt_ids, params)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        tokenizer = self._serving().tokenizer
        return [str(tokenizer.decode([int(i)])) for i in ids]

    def gauges(self) -> MeshGauges:
        serving = self.serving
        load = self.discovery.load
        links = tuple(
            (str(link.src), str(link.dst), float(link.rtt_s), float(link.bandwidth_bps))
            for link in self.discovery.local_record(advance=False).links
        )
        gateway = serving.gateway.statistics() if serving and serving.gateway else None
        shards = serving.shards.statistics() if serving and serving.shards else None
        extra = self.discovery.local_record(advance=False).extra
        mine = read_serving(extra, (), plan_of=None).stage_servers
        memory = extra.get(MEMORY_KEY)
        memory = memory if isinstance(memory, dict) else {}  # hetmesh.node.memory
        stages_kv = tuple(
            (
                f"{s.get('start')}-{s.get('end')}",
                {k: float(v) for k, v in s.items() if k.startswith("kv_") and _number(v)},
            )
            for s in mine
        )
        return MeshGauges(
            ready=self.ready(),
            plan_epoch=serving.plan.epoch if serving and serving.plan else -1,
            queue_depth=load.queue_depth,
            active_sessions=load.active_sessions,
            gateway_sessions=gateway.active_sessions if gateway else 0,
            kv_bytes_used=load.kv_bytes_used,
            kv_bytes_free=load.kv_bytes_free,
            recoveries=gateway.recoveries if gateway else 0,
            rejected_busy=gateway.rejected_busy if gateway else 0,
            tokens_out=gateway.tokens_out if gateway else 0,
            sessions_failed=gateway.sessions_failed if gateway else 0,
            prefix_tokens_skipped=gateway.prefix_tokens_skipped if gateway else 0,
            verify_steps=gateway.verify_steps if gateway else 0,
            drafted=gateway.drafted if gateway else 0,
            accepted=gateway.accepted if gateway else 0,
            verified_tokens=gateway.verified_tokens if gateway else 0,
            links=links,
            shard_bytes_fetched=shards.bytes_fetched if shards else 0,
            shard_bytes_served=shards.bytes_served if shards else 0,
            shard_verification_failures=shards.verification_failures if shards else 0,
            stages_kv=stages_kv,
            memory_in_use_bytes=int(memory.get("in_use", 0)),
            memory_charged_bytes=int(memory.get("charged", 0)),
            memory_runtime_bytes=int(memory.get("runtime", 0)),
        )

    def view(self) -> dict[str, Any]:
        return self.discovery.view()


class ModelsBackend:
    """Several members' backends, one per model (:mod:`hetmesh.node.models`): a request
    goes to the member serving its ``model``; what is not about one model (health, the
    mesh view, the gauges) is the first member's, whose discovery sees the whole mesh.

    ``members``: the running members' backends by model, read at each call (a model
    added or removed changes what is served at once).
    """

    def __init__(
        self,
        members: Callable[[], Mapping[str, NodeBackend]],
        announce: Callable[[str, int], None] | None = None,
        seen: Callable[[str], None] | None = None,
    ) -> None:
        self._members = members
        self._announce = announce
        self._seen = seen  # told each request's model (the demand signal, node.placer)

    def _first(self) -> NodeBackend:
        for backend in self._members().values():
            return backend
        raise errors.NoRoute("this node serves no model now")

    def models(self) -> list[str]:
        return list(self._members())

    def for_model(self, model: str) -> NodeBackend:
        found = self._members().get(model)
        if found is None:
            raise errors.ModelNotFound(
                f"the model {model!r} is not served here; this node serves "
                f"{', '.join(self._members()) or 'nothing now'}"
            )
        if self._seen is not None:
            self._seen(model)
        return found

    def remote_apis(self) -> dict[str, list[str]]:
        return self._first().remote_apis()

    def announce_api(self, host: str, port: int) -> None:
        """Every member announces the API (``announce``: members added later too)."""
        if self._announce is not None:
            self._announce(host, port)
        else:
            for backend in self._members().values():
                backend.announce_api(host, port)

    def max_context(self) -> int:
        return self._first().max_context()

    def ready(self) -> bool:
        """Every model has a ready pipeline."""
        members = self._members()
        return bool(members) and all(b.ready() for b in members.values())

    async def encode(self, request: GenerateRequest) -> list[int]:
        return await self._first().encode(request)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        return self._first().stream(prompt_ids, params)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return self._first().token_texts(ids)

    def gauges(self) -> MeshGauges:
        """The members' counters summed; each stage's KV labelled with its model; the
        links, plan epoch and memory (the process's, whichever member reads it) the
        first member's."""
        members = self._members()
        if not members:
            return MeshGauges()
        each = {model: b.gauges() for model, b in members.items()}
        first = next(iter(each.values()))
        summed = {
            f.name: sum(getattr(g, f.name) for g in each.values())
            for f in dataclasses.fields(MeshGauges)
            if f.name in _SUMMED
        }
        stages = tuple((f"{m}:{u}", kv) for m, g in each.items() for u, kv in g.stages_kv)
        ready = all(g.ready for g in each.values())
        return dataclasses.replace(first, ready=ready, stages_kv=stages, **summed)

    def view(self) -> dict[str, Any]:
        return self._first().view()


# the gauges a node serving several models adds up over its members
_SUMMED = frozenset(
    {
        "queue_depth",
        "active_sessions",
        "gateway_sessions",
        "kv_bytes_used",
        "kv_bytes_free",
        "recoveries",
        "rejected_busy",
        "tokens_out",
        "sessions_failed",
        "prefix_tokens_skipped",
        "verify_steps",
        "drafted",
        "accepted",
        "verified_tokens",
        "shard_bytes_fetched",
        "shard_bytes_served",
        "shard_verification_failures",
    }
)


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = ["ModelsBackend", "NodeBackend"]
