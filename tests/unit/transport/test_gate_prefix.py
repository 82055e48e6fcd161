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
        ("192.168.1.23", "192.168.1.23"),  # a private LAN's: each on its own too
        ("10.4.5.6", "10.4.5.6"),
        ("172.20.0.3", "172.20.0.3"),
        ("fe80::1%eth0", "fe80::1%eth0"),
        ("fd12:3456::7", "fd12:3456::7"),
        ("100.64.1.2", "100.64.1.0/24"),  # carrier-grade NAT: one network of many
        ("::1", "::1"),
        ("not-an-ip", "not-an-ip"),
    ],
)
def test_source_prefix(address: str, prefix: str) -> None:
    assert source_prefix(address) == prefix


def test_four_addresses_of_one_network_no_longer_fill_the_data_planes_gate() -> None:
    """The data plane's caps (64 in all, 16 per address): before, four addresses of one
    /24 took all 64 places and a member dialling from elsewhere was refused. A public
    network keeps to its share (16) once the gate is half full: it holds 32 at most."""
    gate = ConnectionGate(max_total=64, max_per_address=16)
    taken = sum(gate.admit(f"198.51.100.{1 + i % 4}") for i in range(64))
    assert taken == 32
    assert gate.admit("192.0.2.10")  # a member elsewhere still gets in
    # an IPv6 stranger's /64 holds 2**64 addresses: one network, one share
    assert sum(gate.admit(f"2001:db8::{i:x}") for i in range(1, 65)) == 16
    assert gate.statistics().pending == 49
    for i in range(17):
        gate.release(f"198.51.100.{1 + i % 4}")
    assert gate.admit("198.51.100.200")  # released places return to the network


def test_loopback_addresses_are_counted_one_by_one() -> None:
    gate = ConnectionGate(max_total=32, max_per_address=8)
    assert sum(gate.admit(f"127.0.0.{2 + i % 4}") for i in range(32)) == 32


@pytest.mark.parametrize(
    ("caps", "per_address"),
    [
        ((32, 8, None), 1),  # the probe port's gate: every member probes at once
        ((64, 8, 16), 2),  # the libp2p port's upgrades
        ((64, 16, None), 3),  # the data plane's
    ],
)
def test_members_of_one_lan_are_never_starved_by_the_network_cap(
    caps: tuple[int, int, int | None], per_address: int
) -> None:
    """A home LAN is one /24 of different machines (issue 45): twenty members starting
    together each hold a few pending connections to one node. Before, the /24's share
    (8 or 16) refused the rest; now only the caps per address and in all apply."""
    total, address_cap, prefix_cap = caps
    gate = ConnectionGate(total, address_cap, prefix_cap)
    lan = [f"192.168.1.{10 + i}" for i in range(20)]
    wanted = min(total, 20 * per_address)
    assert sum(gate.admit(a) for a in lan for _ in range(per_address)) == wanted


def test_an_ipv6_home_network_takes_half_the_gate_alone() -> None:
    """A public /64 (where SLAAC puts a home LAN) counts against its share only while the
    gate is half full: alone, its members take half the places, then its share holds."""
    gate = ConnectionGate(max_total=32, max_per_address=8)
    home = [f"2001:db8:1:2::{i:x}" for i in range(1, 21)]
    assert sum(gate.admit(a) for a in home) == 16
    assert gate.admit("2001:db8:9:9::1")  # another network still gets in
