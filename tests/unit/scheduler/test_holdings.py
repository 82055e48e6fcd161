"""Units nobody holds cannot be planned: a pure rule over the announced holdings."""

from __future__ import annotations

import pytest

from hetmesh.scheduler.holdings import unheld_units, unheld_verdict

M = "ab" * 32
OTHER = "cd" * 32


@pytest.mark.parametrize(
    ("holdings", "unheld"),
    [
        ([(M, [(0, 6)])], []),
        ([(M, [(0, 2)]), (M, [(2, 6)])], []),
        ([(M, [(0, 2)]), (M, [(4, 6)])], [2, 3]),
        ([(M, [])], [0, 1, 2, 3, 4, 5]),
        ([(M, [(0, 3)]), (OTHER, [(0, 6)])], [3, 4, 5]),  # another model's bytes do not count
        ([(M, [(0, 3)]), ("", [])], []),  # a peer with no manifest holds the whole model
        ([(M, [(4, 99)])], [0, 1, 2, 3]),  # runs beyond the model are clipped
        ([], [0, 1, 2, 3, 4, 5]),
    ],
)
def test_unheld_units(holdings: list[tuple[str, list[tuple[int, int]]]], unheld: list[int]) -> None:
    assert unheld_units(6, holdings, M) == unheld


def test_verdict_names_the_units() -> None:
    assert unheld_verdict("m", []) == ""
    text = unheld_verdict("m", [2, 3, 5])
    assert "[2, 4), [5, 6)" in text
    assert "ModelNotFound" in text
