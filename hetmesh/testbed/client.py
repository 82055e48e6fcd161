"""Greedy generations through a mesh node, timed; run inside a testbed host.

``python -m hetmesh.testbed.client ADDR --secret S --prompt-ids 1,2,3 --max-new-tokens N``
prints one JSON line per generation: ``tokens`` (ids), ``times_s`` (arrival of
each token, seconds after the request), ``finish_reason`` — or ``error`` and
``message`` when the mesh refuses the request (the exit status stays 0: the
refusal is the answer).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio


async def generations(
    addr: str, *, secret: str, prompt_ids: list[int], max_new_tokens: int, repeat: int = 1
) -> list[dict[str, Any]]:
    """``repeat`` greedy generations through the node at ``addr``, one dict each."""
    from hetmesh.client.mesh import Finished, TokenEvent, open_mesh_client
    from hetmesh.errors import MeshError

    results = []
    async with open_mesh_client(addr, mesh_secret=secret, timeout_s=120.0) as mesh:
        for _ in range(repeat):
            began = time.perf_counter()
            out: dict[str, Any] = {"tokens": [], "times_s": []}
            try:
                stream = mesh.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens)
                async for event in stream:
                    if isinstance(event, TokenEvent) and event.token_id >= 0:
                        out["tokens"].append(event.token_id)
                        out["times_s"].append(time.perf_counter() - began)
                    elif isinstance(event, Finished):
                        out["finish_reason"] = event.finish_reason
            except MeshError as exc:
                out = {"error": type(exc).__name__, "message": str(exc)}
            out["elapsed_s"] = time.perf_counter() - began
            results.append(out)
    return results


async def _run(args: argparse.Namespace) -> None:
    ids = [int(t) for t in args.prompt_ids.split(",") if t]
    for out in await generations(
        args.addr,
        secret=args.secret,
        prompt_ids=ids,
        max_new_tokens=args.max_new_tokens,
        repeat=args.repeat,
    ):
        print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("addr")
    parser.add_argument("--secret", required=True)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1)
    trio.run(_run, parser.parse_args())


if __name__ == "__main__":
    main()
