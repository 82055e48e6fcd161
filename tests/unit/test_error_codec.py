"""The one mapping of the error tree to the wire (names and codes) and back."""

from __future__ import annotations

import pytest

from hetmesh import errors
from hetmesh.error_codec import error_code, error_from_wire, error_name

TREE = [
    value
    for value in vars(errors).values()
    if isinstance(value, type) and issubclass(value, errors.MeshError)
]


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_every_error_round_trips_by_name_and_by_code(cls: type[errors.MeshError]) -> None:
    sent = cls("what went wrong")
    for key in (error_name(sent), error_code(sent)):
        back = error_from_wire(key, str(sent))
        assert type(back) is cls
        assert str(back) == "what went wrong"


def test_codes_are_unique_and_keep_the_data_planes_historical_numbers() -> None:
    codes = [error_code(cls) for cls in TREE]
    assert len(set(codes)) == len(TREE)
    # protocol (a bad request), auth, internal, fallback: what peers sent before the codec
    assert error_code(errors.InvalidRequest) == 1
    assert error_code(errors.AuthenticationFailed) == 2
    assert error_code(errors.ComputeError) == 3
    assert error_code(errors.PeerUnreachable) == 4


def test_errors_outside_the_tree_travel_as_their_nearest_tree_class() -> None:
    class Overloaded(errors.Rejected):
        pass

    assert error_name(Overloaded("x")) == "Rejected"
    assert error_code(Overloaded) == error_code(errors.Rejected)
    assert error_name(ValueError("x")) == "MeshError"
    assert error_code(RuntimeError) == error_code(errors.MeshError)


@pytest.mark.parametrize("key", ["NotAnError", "", 999, -1, True, None, "find_in_group"])
def test_unknown_names_and_codes_become_a_plain_mesh_error(key: object) -> None:
    err = error_from_wire(key, "boom")
    assert type(err) is errors.MeshError
    assert "boom" in str(err)
