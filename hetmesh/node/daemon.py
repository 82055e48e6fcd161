"""The node daemon: one trio nursery tree.

```
run_node(config)
└── open_host                      libp2p host (identity, psk, noise, yamux)
    └── nursery
        ├── serve_discovery        announcements, membership, liveness, link probes,
        │                          status RPC (Discovery.serve)
        ├── serve_profiling        measured DeviceProfiles, refreshed when idle
        ├── Reachability.serve     dial-backs: public / behind NAT (hetmesh.nat)
        ├── RelayClient.serve      relay slots: offered when public, held behind NAT
        └── serve_model            plans, stages, data-plane links, sessions
                                   (hetmesh.node.serving; absent with --no-serve)
```

Each service is ``serve_*(node, task_status=...)``: it reports readiness with
``task_status.started()`` and then runs until cancelled. A graceful stop
(``node.request_stop()``, which the CLI calls on SIGINT/SIGTERM) sends the
goodbye while the host is still up and then cancels the root scope; a bare
cancellation still tries the goodbye from a shielded, bounded ``finally``.
Later services (stages, sessions, scheduler) take the same :class:`Node` and
are added to :func:`run_node` with one ``await nursery.start(serve_x, node)``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery import profiling
from hetmesh.discovery.host import derive_psk, load_or_create_identity, open_host
from hetmesh.discovery.service import Discovery, DiscoveryConfig
from hetmesh.nat.dialback import Reachability
from hetmesh.nat.relay import RelayClient
from hetmesh.node.memory import (
    MEMORY_KEY,
    MemoryReport,
    charged_bytes,
    memory_in_use,
    offered_cap,
)
from hetmesh.node.runtime import Node, NodeConfig, default_data_dir

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

NODE_INFO_FILE = "node.json"


async def serve_discovery(
    node: Node, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    await node.discovery.serve(task_status=task_status)


async def serve_profiling(
    node: Node, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Publish measured DeviceProfiles; ready once the first benchmark is in."""
    cfg = node.config

    def measure(refresh: bool) -> tuple[profiling.Benchmark, dict[int, float]]:
        bench = profiling.benchmark_cpu(
            cfg.data_dir, refresh=refresh, budget_s=cfg.benchmark_budget_s
        )
        gpu = (
            profiling.measure_gpu_flops()
            if cfg.device in (None, "cuda") or (cfg.device or "").startswith("cuda")
            else {}
        )
        return bench, gpu

    def profiles(bench: profiling.Benchmark, gpu: dict[int, float]) -> Any:
        # a draft model at the gateway is this node's memory, beside the plan's stages
        beside = node.serving.beside_plan_bytes() if node.serving is not None else 0
        return profiling.device_profiles(
            node.peer_id,
            bench,
            gpu_flops=gpu,
            max_memory_bytes=offered_cap(cfg.max_memory_bytes, beside),
            only=cfg.device,
        )

    # what the process holds before any stage: the runtime the plan does not charge
    memory = MemoryReport(runtime=memory_in_use().bytes)
    bench, gpu = await trio.to_thread.run_sync(measure, False, limiter=node.device_limiter)
    node.discovery.set_devices(await trio.to_thread.run_sync(profiles, bench, gpu))
    _publish_memory(node, memory)
    log.info(
        "profiled: %.1f GFLOP/s, %.1f GB/s memory",
        bench.matmul_flops / 1e9,
        bench.memory_bandwidth_bps / 1e9,
    )
    task_status.started()
    last_bench = trio.current_time()
    while True:
        await trio.sleep(cfg.profile_update_s)
        busy = node.discovery.load.active_sessions > 0 or node.discovery.load.queue_depth > 0
        due = trio.current_time() - last_bench >= cfg.benchmark_refresh_s and not busy
        if due and await trio.to_thread.run_sync(profiling.system_idle):
            bench, gpu = await trio.to_thread.run_sync(measure, True, limiter=node.device_limiter)
            last_bench = trio.current_time()
        node.discovery.set_devices(await trio.to_thread.run_sync(profiles, bench, gpu))
        _publish_memory(node, memory)


def _publish_memory(node: Node, report: MemoryReport) -> None:
    """Announce the memory in use beside the plan's charge (:mod:`hetmesh.node.memory`)."""
    serving = node.serving
    plan = serving.plan if serving is not None else None
    used = memory_in_use()
    if serving is None or not serving.stages.holding():  # the runtime: no stage yet
        report.runtime = max(report.runtime, used.bytes)
    entry = report.update(used, charged_bytes(plan, node.peer_id))
    if entry is not None:
        node.discovery.set_counters(MEMORY_KEY, entry)  # moves with the KV: with the load


def _write_node_info(node: Node) -> None:
    info = {"peer_id": node.peer_id, "addrs": list(node.discovery.addrs), "pid": os.getpid()}
    path = node.config.data_dir / NODE_INFO_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


async def run_node(
    config: NodeConfig, *, task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a node until ``node.request_stop()`` (graceful: goodbye first) or cancellation.

    Reports the :class:`Node` through ``task_status``. Raises
    :class:`~hetmesh.errors.AuthenticationFailed` / :class:`~hetmesh.errors.PeerUnreachable`
    when no bootstrap peer accepts us (the CLI prints it and exits non-zero).
    """
    if config.serving is not None:
        import torch

        torch.set_num_threads(config.serving.threads)  # before profiling measures with it
        # The device thread holds the GIL between small kernels; frames arriving on
        # link reader threads must not wait the default 5 ms for it at every hop.
        sys.setswitchinterval(config.serving.gil_switch_interval_s)
    key_pair = load_or_create_identity(config.data_dir)
    psk = derive_psk(config.mesh_secret)
    async with open_host(
        key_pair, psk=psk, listen=config.listen, dial_timeout_s=config.dial_timeout_s
    ) as host:
        discovery = Discovery(
            host,
            DiscoveryConfig(
                bootstrap=config.bootstrap,
                mdns=config.mdns,
                mesh_secret=config.mesh_secret,
                policy=config.liveness,
                dial_timeout_s=config.dial_timeout_s,
                link_probe_interval_s=config.link_probe_interval_s,
            ),
            psk=psk,
        )
        node = Node(config=config, host=host, discovery=discovery)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_discovery, node)
            for addr in discovery.addrs:
                log.info("listening on %s", addr)
            log.info("peer id %s", node.peer_id)
            await nursery.start(serve_profiling, node)
            discovery.enable_link_probes()
            # members dial us back: public / behind NAT, published in our record; behind
            # NAT we hold a slot on a public member's relay, public we offer slots
            reachability = Reachability(discovery, nat=node.nat)
            await nursery.start(reachability.serve)
            relay = RelayClient(discovery, reachability, offer=config.relay, nat=node.nat)
            await nursery.start(relay.serve)
            if config.serving is not None:
                from hetmesh.node.serving import serve_model

                node.serving = await nursery.start(serve_model, node, config.serving)
            if config.api_port is not None:
                from hetmesh.node.api_serve import serve_api
                from hetmesh.node.backend import NodeBackend

                await nursery.start(
                    functools.partial(
                        serve_api,
                        NodeBackend(node.discovery, node.serving),
                        config.api_port,
                        host=config.api_host,
                        api_key=config.api_key,
                        mesh_secret=config.mesh_secret,
                    )
                )
            _write_node_info(node)
            log.info("node ready")
            task_status.started(node)
            await node.stop_requested.wait()
            if node.serving is not None:  # its sessions move away first (KV migration)
                await node.serving.drain()
            await discovery.say_goodbye()
            nursery.cancel_scope.cancel()


__all__ = [
    "NODE_INFO_FILE",
    "Node",
    "NodeConfig",
    "default_data_dir",
    "run_node",
    "serve_discovery",
    "serve_profiling",
]
