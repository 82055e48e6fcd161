"""Adding and removing a model of a running node over the HTTP API.

A node serving several models (:mod:`hetmesh.node.models`) answers
``POST /v1/hetmesh/models`` (``{"model": NAME, "memory_bytes": N}``: a new
member serving NAME with N bytes) and ``DELETE /v1/hetmesh/models/{id}`` (the
member serving that model stops; its sessions move away first). The other
models' members, plans and streams are not touched. The routes are behind the
API's own guard (its key, or loopback only), and take model *names* only (the
default name, a synth name, ``mesh``, a manifest id): never a path on the node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hetmesh.errors import MeshError
from hetmesh.node.api_requests import ApiError, api_error, bad_request

MAX_MODEL_BODY_BYTES = 4096
MIN_MEMORY_BYTES = 64 << 20


class ModelControl(Protocol):
    """What adds and removes a node's models (:class:`hetmesh.node.models.ModelMembers`)."""

    async def add_model(self, model: str, memory_bytes: int) -> str: ...
    async def remove_model(self, key: str) -> None: ...


def check_model_name(model: Any) -> str:
    """``model`` if it is a name (no path); a 400 otherwise."""
    if (
        not isinstance(model, str)
        or not model
        or len(model) > 200
        or any(c in model for c in "/\\")
        or model.startswith(".")
        or model.endswith((".gguf", ".GGUF"))
    ):
        raise bad_request("model must be a model name (not a path), e.g. synth-tiny", "model")
    return model


def _memory(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_MEMORY_BYTES:
        raise bad_request(
            f"memory_bytes must be an integer of at least {MIN_MEMORY_BYTES}", "memory_bytes"
        )
    return value


def model_routes(
    control: ModelControl, error: Callable[[Request, ApiError], Response]
) -> list[Route]:
    """The two routes over ``control``; ``error`` answers in the API's error shape."""
    import json

    async def add(request: Request) -> Response:
        try:
            raw = await request.body()
            if len(raw) > MAX_MODEL_BODY_BYTES:
                raise bad_request("the body is too large", code="body_too_large")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise bad_request(
                    f"the body is not valid JSON: {exc}", code="invalid_json"
                ) from exc
            if not isinstance(body, dict):
                raise bad_request("the body must be a JSON object")
            model = check_model_name(body.get("model"))
            key = await control.add_model(model, _memory(body.get("memory_bytes")))
        except ApiError as err:
            return error(request, err)
        except MeshError as exc:
            return error(request, api_error(exc))
        return JSONResponse({"id": key, "object": "model", "owned_by": "hetmesh"}, 201)

    async def remove(request: Request) -> Response:
        key = str(request.path_params["model"])
        try:
            await control.remove_model(key)
        except MeshError as exc:
            return error(request, api_error(exc))
        return JSONResponse({"id": key, "object": "model", "deleted": True})

    return [
        Route("/v1/hetmesh/models", add, methods=["POST"]),
        Route("/v1/hetmesh/models/{model}", remove, methods=["DELETE"]),
    ]


__all__ = ["ModelControl", "check_model_name", "model_routes"]
