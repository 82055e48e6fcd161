"""A request for a model another node serves: forwarded to that node's API.

Every node with an HTTP API announces it in its record (:data:`API_KEY`: the
port, and the host it listens on). A completion whose ``model`` this node does
not serve but a live peer announces with an API is sent there (the same body),
and the peer's answer, streamed or not, is relayed back unchanged: every
parameter (structured output, tools, logprobs, ``n``) is the serving node's to
check and honour. A forwarded request carries :data:`FORWARDED_HEADER`; a node
never forwards such a request again (two nodes that each think the other
serves a model answer 404 instead of looping). The peers are tried in order;
none answering is a 503.

What a member announces is not believed blindly: the client's ``Authorization``
never leaves this node (a member could announce any address and collect the
clients' keys); a forwarded request presents :func:`forward_token` instead, a
credential derived from the mesh secret that the receiving node accepts only on
the two completion routes of a forwarded request (:class:`.api_guard.RequireKey`),
so it grants a member nothing a member cannot do over the mesh protocol. And the
announced host must be one of the peer's own announced IP addresses.

Pure of the node: :func:`api_targets` reads the peers' records, :func:`forward`
is the HTTP relay.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from hetmesh.node.api_requests import ApiError
from hetmesh.node.api_stream import HeldStream

log = logging.getLogger(__name__)

API_KEY = "api"  # record extra: {"port": int, "host": str} of the node's HTTP API
FORWARDED_HEADER = "x-hetmesh-forwarded"
FORWARD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_TOKEN_LABEL = b"hetmesh api forward v1"
CONNECT_TIMEOUT_S = 5.0
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_IP_IN_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/")


def api_entry(host: str, port: int) -> dict[str, Any]:
    """What a node announces under :data:`API_KEY`."""
    return {"host": host, "port": int(port)}


def forward_token(mesh_secret: str | None) -> str | None:
    """The credential a forwarded request presents (None without a mesh secret: a
    forwarded request then carries none, and only a keyless peer answers it)."""
    if not mesh_secret:
        return None
    return hmac.new(mesh_secret.encode(), _TOKEN_LABEL, hashlib.sha256).hexdigest()


def _url(entry: object, addrs: Iterable[str]) -> str | None:
    """The base URL of a peer's API from its announced entry and libp2p addresses: a
    wildcard host is reached at the address the peer is known by, any other host
    must be one of those addresses (never a name, never a host of its choosing)."""
    if not isinstance(entry, Mapping):
        return None
    port, host = entry.get("port"), entry.get("host", "")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    found = (_IP_IN_ADDR.match(a) for a in addrs)
    ips = [m.group(2) for m in found if m is not None]
    if not isinstance(host, str) or host in _WILDCARDS:
        if not ips:
            return None
        host = ips[0]
    elif host not in ips:
        return None
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        return None  # a name in an address: not dialled
    return f"http://{host}:{port}"


def api_targets(
    peers: Iterable[tuple[str, Mapping[str, Any], Iterable[str]]],
) -> dict[str, list[str]]:
    """Model -> the API base URLs of the peers serving it, from ``(model, record extra,
    addresses)`` of each live peer (peers with no model or no API left out)."""
    found: dict[str, list[str]] = {}
    for model, extra, addrs in peers:
        url = _url(extra.get(API_KEY), addrs) if model else None
        if url is not None and url not in found.get(model, []):
            found.setdefault(model, []).append(url)
    return found


@dataclass(slots=True)
class Forward(Exception):
    """Raised while parsing a request that goes to ``urls`` instead (``raw``: its body)."""

    urls: list[str]
    raw: bytes


def check_forward(
    request: Request,
    body: object,
    raw: bytes,
    local: Iterable[str],
    remote: Mapping[str, list[str]],
) -> None:
    """Raise :class:`Forward` when ``body`` names a model not served here that a peer
    serves, and the request was not forwarded to this node already."""
    if not isinstance(body, dict) or request.headers.get(FORWARDED_HEADER):
        return
    model = body.get("model")
    if isinstance(model, str) and model not in set(local) and remote.get(model):
        raise Forward(list(remote[model]), raw)


async def forward(
    request: Request, fwd: Forward, release: Callable[[], None], token: str | None = None
) -> Response:
    """Send the request to the first of ``fwd.urls`` that answers, presenting ``token``
    (:func:`forward_token`; never the client's own credential); relay its answer (a
    stream chunk by chunk, giving the client's slot back at its end)."""
    headers = {"content-type": "application/json", FORWARDED_HEADER: "1"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    for base in fwd.urls:
        client = httpx.AsyncClient(timeout=timeout)
        try:
            sent = client.build_request(
                "POST", base + request.url.path, content=fwd.raw, headers=headers
            )
            reply = await client.send(sent, stream=True)
        except httpx.HTTPError as exc:
            await client.aclose()
            log.info("forwarding to %s failed: %s; trying the next peer", base, exc)
            continue
        kind = reply.headers.get("content-type", "application/json")
        log.info("forwarded %s to %s (%d)", request.url.path, base, reply.status_code)
        if kind.startswith("text/event-stream"):
            stream = HeldStream(_relay(reply, client), release, media_type="text/event-stream")
            stream.status_code = reply.status_code
            return stream
        try:
            content = await reply.aread()
        finally:
            await reply.aclose()
            await client.aclose()
        return Response(content, status_code=reply.status_code, media_type=kind)
    raise ApiError(
        503,
        "no node serving this model answered; try again",
        "server_error",
        code="model_unreachable",
    )


async def _relay(reply: httpx.Response, client: httpx.AsyncClient) -> AsyncIterator[str]:
    try:
        async for chunk in reply.aiter_text():
            yield chunk
    finally:
        await reply.aclose()
        await client.aclose()


__all__ = [
    "API_KEY",
    "FORWARDED_HEADER",
    "Forward",
    "api_entry",
    "api_targets",
    "check_forward",
    "forward",
]
