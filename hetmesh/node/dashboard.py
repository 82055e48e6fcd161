"""The web dashboard: a static page shipped in the package plus the live feed's SSE route.

``GET /`` serves ``web/index.html`` and ``GET /dashboard/<file>`` its scripts
and styles; they hold no data, so they are served without the API key (the
page then asks for the key and sends it as a Bearer token on every data
route). ``GET /v1/hetmesh/events`` streams :class:`~hetmesh.node.events.Feed`
as server-sent events: ``hello`` first, then ``snapshot`` once a tick and
``mesh-event`` as things happen. The files are read once, when the app is
built; only names found in the folder are served (no paths from the URL
reach the file system).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from hetmesh.errors import MeshError
from hetmesh.node.api_requests import ApiError, api_error
from hetmesh.node.events import Feed

ASSET_PREFIX = "/dashboard/"

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

# Everything the page loads comes from this node: no CDN, nothing inline.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """The page's files by name: ``{"index.html": (content, media type), ...}``."""
    folder = resources.files("hetmesh.node").joinpath("web")
    out = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in _TYPES:
            out[item.name] = (item.read_bytes(), _TYPES[suffix])
    if "index.html" not in out:
        raise FileNotFoundError(f"the dashboard's index.html is missing from {folder}")
    return out


def is_open_path(path: str) -> bool:
    """Paths served without the API key: the static page (no data in it)."""
    return path == "/" or path.startswith(ASSET_PREFIX)


def dashboard_routes(feed: Feed, error: Callable[[Request, ApiError], Response]) -> list[Route]:
    """The page's routes; ``error`` answers a refused stream in the API's error shape."""
    assets = load_assets()

    def asset(name: str) -> Response:
        content, media_type = assets[name]
        return Response(content, media_type=media_type, headers=_HEADERS)

    async def index(request: Request) -> Response:
        return asset("index.html")

    async def static(request: Request) -> Response:
        name = str(request.path_params["name"])
        if name not in assets or name == "index.html":
            return error(request, ApiError(404, f"no dashboard file {name!r}", code="not_found"))
        return asset(name)

    async def events(request: Request) -> Response:
        try:
            subscription = feed.subscribe()
        except MeshError as exc:
            return error(request, api_error(exc))

        async def body() -> AsyncIterator[str]:
            with subscription as receive:
                yield feed.hello()
                async for message in receive:
                    yield message

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    return [
        Route("/", index, methods=["GET"]),
        Route(ASSET_PREFIX + "{name}", static, methods=["GET"]),
        Route("/v1/hetmesh/events", events, methods=["GET"]),
    ]


__all__ = ["ASSET_PREFIX", "dashboard_routes", "is_open_path", "load_assets"]
