"""The pure admission gate for unauthenticated connections."""

from __future__ import annotations

import pytest

from hetmesh.errors import LocalProtocolError
from hetmesh.transport.gate import ConnectionGate


def test_gate_caps_in_total_and_per_address() -> None:
    gate = ConnectionGate(max_total=3, max_per_address=2)
    assert gate.admit("a")
    assert gate.admit("a")
    assert not gate.admit("a")  # per address
    assert gate.admit("b")
    assert not gate.admit("c")  # in total
    gate.release("a")
    assert gate.admit("c")
    assert gate.statistics().pending == 3
    assert gate.statistics().refused == 2


def test_gate_refuses_a_release_it_did_not_admit() -> None:
    gate = ConnectionGate(max_total=1, max_per_address=1)
    with pytest.raises(LocalProtocolError):
        gate.release("a")
