"""Serving the node's HTTP API (:mod:`hetmesh.node.api`'s app) with hypercorn.

:func:`serve_api` is what a node starts (``--api-port``): it serves the app and
announces the API in the node's record so peers can forward to it;
:func:`serve_http` is the supervised server itself.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import trio

from hetmesh import errors
from hetmesh.errors import find_in_group
from hetmesh.node.api import Backend, ClientPolicy, build_app
from hetmesh.node.api_forward import forward_token
from hetmesh.node.api_guard import LocalGuard, check_api_bind
from hetmesh.node.api_metrics import ApiMetrics
from hetmesh.node.api_models import ModelControl

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from hetmesh.node.backend import ModelsBackend, NodeBackend

log = logging.getLogger("hetmesh.node.api")


async def serve_http(
    backend: Backend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    policy: ClientPolicy | None = None,
    models: ModelControl | None = None,
    forward_token: str | None = None,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API for ``backend`` on ``host:port`` (0: any free port); reports its URL.
    ``models``: a node serving several models adds and removes them there;
    ``forward_token``: what requests forwarded to and from peers present.

    The HTTP server is supervised: if hypercorn itself fails (not a request:
    those are answered with a 500), it is logged and restarted on the same
    port, so the API never takes the node down with it.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    check_api_bind(host, api_key)
    metrics = ApiMetrics(backend)
    url: str | None = None
    guard = LocalGuard.for_bind(host, port)
    async with trio.open_nursery() as streams:  # producers of streamed responses
        app = build_app(
            backend,
            metrics,
            streams,
            api_key=api_key,
            policy=policy,
            guard=guard,
            models=models,
            forward_token=forward_token,
        )
        while True:
            config = Config()
            config.bind = [f"{host}:{port}"]
            config.accesslog = None
            config.errorlog = logging.getLogger("hetmesh.node.api.http")  # type: ignore[assignment]
            config.graceful_timeout = 1.0
            try:
                async with trio.open_nursery() as nursery:
                    binds: list[str] = await nursery.start(
                        functools.partial(serve, app, config, shutdown_trigger=trio.sleep_forever)  # type: ignore[arg-type]
                    )
                    if url is None:
                        url = binds[0] if binds else f"http://{host}:{port}"
                        port = int(url.rsplit(":", 1)[1])
                        guard.port = port
                        log.info("HTTP API on %s", url)
                        task_status.started(url)
            except Exception as exc:  # never let the HTTP server take the node down
                if url is None:
                    bind = find_in_group(exc, OSError)
                    if bind is not None:  # could not listen at start: say so in one line
                        raise errors.TransportError(
                            f"the HTTP API cannot listen on {host}:{port}: {bind.strerror or bind}"
                        ) from exc
                    raise
                log.error("the HTTP server failed; restarting it", exc_info=exc)
            await trio.sleep(1.0)


async def serve_api(
    backend: NodeBackend | ModelsBackend,
    port: int,
    *,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    mesh_secret: str | None = None,
    models: ModelControl | None = None,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The node's OpenAI-compatible API on ``host:port`` for ``backend``; never returns.
    Requests forwarded between nodes present a token derived from ``mesh_secret``.

    The daemon passes a :class:`~hetmesh.node.backend.NodeBackend`; a node serving
    several models a :class:`~hetmesh.node.backend.ModelsBackend` and its ``models``.
    """
    async with trio.open_nursery() as nursery:
        token = forward_token(mesh_secret)
        serve = functools.partial(
            serve_http, backend, host=host, port=port, api_key=api_key, forward_token=token
        )
        url: str = await nursery.start(functools.partial(serve, models=models))
        backend.announce_api(host, int(url.rsplit(":", 1)[1]))  # peers forward to it
        task_status.started(url)


__all__ = ["serve_api", "serve_http"]
