"""Who the HTTP API answers: the API key, loopback-only requests, bounded metrics labels.

With an API key (``--api-key``) every route but ``/health`` and the dashboard's
static files wants ``Authorization: Bearer KEY`` (:class:`RequireKey`). Without
one the API listens on loopback only (:func:`check_api_bind`) and answers only
requests that name this machine in ``Host`` and carry no other site's
``Origin`` (:class:`LocalOnly`): a web page the operator visits can neither
post to it cross-site (CSRF) nor reach it through a name of its own that
resolves to 127.0.0.1 (DNS rebinding). Metrics label a request by its route's
template (:func:`route_label`), never the raw path. What the API shows of the
node's status leaves out the prefix-cache hashes (:func:`redacted_view`).

The API key is the clients' credential and the mesh secret the members': a node
refuses a key equal to its secret (:func:`check_client_key`), so whoever may ask
for completions cannot also join the mesh.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hetmesh import errors
from hetmesh.node.api_forward import FORWARD_PATHS, FORWARDED_HEADER
from hetmesh.node.api_requests import LOOPBACK_NAMES, foreign_request
from hetmesh.node.dashboard import is_open_path
from hetmesh.scheduler.prefix_summary import decode_summary

_OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers)


class RequireKey:
    """ASGI middleware: HTTP requests must present ``Authorization: Bearer <key>``; a
    request another node forwarded (:mod:`.api_forward`) may present that node's
    ``forwarded`` token instead, on the completion routes only."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        key: str,
        reject: Callable[[Request], Response],
        forwarded: str | None = None,
    ) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.forwarded = f"Bearer {forwarded}".encode() if forwarded else None
        self.reject = reject

    def _allowed(self, scope: Scope, given: bytes, headers: dict[bytes, bytes]) -> bool:
        if hmac.compare_digest(given, self.expected):
            return True
        return (
            self.forwarded is not None
            and scope.get("method") == "POST"
            and scope.get("path", "") in FORWARD_PATHS
            and FORWARDED_HEADER.encode() in headers
            and hmac.compare_digest(given, self.forwarded)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in _OPEN_PATHS and not is_open_path(path):
            headers = dict(scope.get("headers") or ())
            if not self._allowed(scope, headers.get(b"authorization", b""), headers):
                response = self.reject(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass(slots=True)
class LocalGuard:
    """What an API without a key (loopback only) answers to: these host names, on
    ``port`` (None until it listens)."""

    allowed: frozenset[str] = LOOPBACK_NAMES
    port: int | None = None

    @classmethod
    def for_bind(cls, host: str, port: int) -> LocalGuard:
        return cls(LOOPBACK_NAMES | {host.strip("[]").lower()}, port or None)


class LocalOnly:
    """ASGI middleware of an API without a key: requests whose Host or Origin names
    another site are refused (403): a web page the operator visits cannot drive it."""

    def __init__(
        self, app: ASGIApp, *, guard: LocalGuard, reject: Callable[[Request, str], Response]
    ) -> None:
        self.app = app
        self.guard = guard
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            origin = headers.get(b"origin")
            why = foreign_request(
                headers.get(b"host", b"").decode("latin-1"),
                origin.decode("latin-1") if origin is not None else None,
                allowed=self.guard.allowed,
                port=self.guard.port,
            )
            if why is not None:
                response = self.reject(Request(scope, receive), why)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def redacted_view(view: Any) -> Any:
    """``view`` (a node's status) with every stage's prefix-cache summary replaced by
    its count of blocks: the summaries are hashes of prompts' leading tokens, and a
    client who may read status must not confirm what another client asked."""
    if isinstance(view, dict):
        return {
            key: _counts(value) if key == PREFIX_SUMMARIES else redacted_view(value)
            for key, value in view.items()
        }
    if isinstance(view, list | tuple):
        return [redacted_view(item) for item in view]
    return view


PREFIX_SUMMARIES = "prefix_summaries"


def _counts(summaries: Any) -> Any:
    if not isinstance(summaries, list | tuple):
        return []
    out = []
    for item in summaries:
        if isinstance(item, list | tuple) and len(item) == 3:
            out.append([item[0], item[1], len(decode_summary(item[2]))])
    return out


UNMATCHED_ROUTE = "unmatched"


def route_label(path: str, routes: Sequence[Route]) -> str:
    """The template of the route that serves ``path`` (whatever the method), else
    :data:`UNMATCHED_ROUTE`: a bounded set of labels whatever paths clients send."""
    for route in routes:
        if route.path_regex.match(path):
            return route.path
    return UNMATCHED_ROUTE


def check_api_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose the API beyond loopback without a key (a clear error, not a warning)."""
    if api_key:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise errors.InvalidRequest(
            f"the HTTP API on {host} would be open to anyone who reaches it: "
            "give --api-key (or HETMESH_API_KEY), or keep --api-host 127.0.0.1"
        )


def check_client_key(api_key: str | None, mesh_secret: str | None) -> None:
    """Refuse an API key that is also the mesh secret: the key is what clients hold, and
    it must not also let them join the mesh (announce, gossip, sign)."""
    if (
        api_key
        and mesh_secret is not None
        and hmac.compare_digest(api_key.encode(), mesh_secret.encode())
    ):
        raise errors.InvalidRequest(
            "the API key is the mesh secret: clients given the key could join the mesh as "
            "members; choose an API key of its own"
        )


__all__ = [
    "UNMATCHED_ROUTE",
    "LocalGuard",
    "LocalOnly",
    "RequireKey",
    "check_api_bind",
    "check_client_key",
    "redacted_view",
    "route_label",
]
