"""The admission gate counts a stranger's addresses by network too."""

from __future__ import annotations

import pytest

from hetmesh.transport.gate import ConnectionGate, source_prefix


@pytest.mark.parametrize(
    ("address", "prefix"),
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("::ffff:203.0.113.7", "203.0.113.0/24"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("[2001:db8:1:2::9]", "2001:db8:1:2::/64"),
        ("127.0.0.5", "127.0.0.5"),  # loopback: each on its own
        ("::1", "::1"),
        ("not-an-ip", "not-an-ip"),
    ],
)
def test_source_prefix(address: str, prefix: str) -> None:
    assert source_prefix(address) == prefix


def test_four_addresses_of_one_network_no_longer_fill_the_data_planes_gate() -> None:
    """The data plane's caps (64 in all, 16 per address): before, four addresses of one
    /24 took all 64 places and a member dialling from elsewhere was refused."""
    gate = ConnectionGate(max_total=64, max_per_address=16)
    taken = sum(gate.admit(f"198.51.100.{1 + i % 4}") for i in range(64))
    assert taken == 16
    assert gate.admit("192.0.2.10")  # a member elsewhere still gets in
    # an IPv6 stranger's /64 holds 2**64 addresses: one network, one share
    assert sum(gate.admit(f"2001:db8::{i:x}") for i in range(1, 65)) == 16
    assert gate.statistics().pending == 33
    for i in range(16):
        gate.release(f"198.51.100.{1 + i % 4}")
    assert gate.admit("198.51.100.200")  # released places return to the network


def test_loopback_addresses_are_counted_one_by_one() -> None:
    gate = ConnectionGate(max_total=32, max_per_address=8)
    assert sum(gate.admit(f"127.0.0.{2 + i % 4}") for i in range(32)) == 32
