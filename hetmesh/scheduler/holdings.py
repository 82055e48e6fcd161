"""Which units a mesh can serve at all: those some live peer holds on disk (pure).

A node started without the model fetches its stage's tensors from peers that
hold them (:mod:`hetmesh.shards`), so any member can be planned any unit that
*some* member holds; a unit nobody holds cannot be served by anyone, and the
coordinator must not plan the model until a holder appears. Peers that announce
no manifest (older nodes, or a folder that could not be described) are taken
to hold the whole model, as before manifests existed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def unheld_units(
    num_units: int, holdings: Iterable[tuple[str, Sequence[tuple[int, int]]]], manifest: str
) -> list[int]:
    """The units of ``[0, num_units)`` that no peer holds.

    ``holdings``: (manifest id announced, unit runs held) per live member, this
    node included. A member announcing ``""`` holds everything; one announcing
    another manifest holds nothing of this model.
    """
    held: set[int] = set()
    for announced, runs in holdings:
        if not announced:
            return []
        if announced != manifest:
            continue
        for start, end in runs:
            held.update(range(max(0, start), min(end, num_units)))
    return [u for u in range(num_units) if u not in held]


def unheld_verdict(model: str, units: Sequence[int]) -> str:
    """Why the model cannot be placed when ``units`` are held by nobody ("" if none)."""
    if not units:
        return ""
    runs: list[list[int]] = []
    for u in sorted(units):
        if runs and runs[-1][1] == u:
            runs[-1][1] = u + 1
        else:
            runs.append([u, u + 1])
    text = ", ".join(f"[{a}, {b})" for a, b in runs)
    return f"no live peer holds units {text} of {model} (ModelNotFound): start a node that has it"


__all__ = ["unheld_units", "unheld_verdict"]
