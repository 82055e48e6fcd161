"""The NAT testbed itself: routers masquerade, nothing dials into a home, symmetric mode."""

from __future__ import annotations

import subprocess

import pytest

from hetmesh.testbed.nat import nat_unavailable_reason, open_nat_testbed, try_dial, udp_mappings

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_nat_testbed_homes_reach_out_but_nothing_reaches_in() -> None:
    reason = nat_unavailable_reason(need_tc=True)
    if reason:
        pytest.skip(reason)
    with open_nat_testbed(2, symmetric={1}, rate="100mbit") as bed:
        prefix = bed.prefix
        assert {h.namespace for h in bed.hosts} <= _namespaces()
        public, home0, home1 = bed.hosts
        # a home host reaches the public host, which sees its router's WAN address
        assert try_dial(bed, home0, public) == home0.public_ip
        assert try_dial(bed, home1, public) == home1.public_ip
        # nothing on the WAN has a route into a home, nor one home into the other
        assert try_dial(bed, public, home0, timeout_s=1.5) is None
        assert try_dial(bed, home0, home1, timeout_s=1.5) is None
        assert try_dial(bed, home1, home0, timeout_s=1.5) is None
        # home 0 is a cone NAT: one socket keeps one mapping whatever the destination;
        # home 1 is symmetric: a fresh mapping per destination
        cone = udp_mappings(bed, home0, public)
        assert cone[0] == cone[1]
        assert cone[0].startswith(f"{home0.public_ip}:")
        symmetric = udp_mappings(bed, home1, public)
        assert symmetric[0].startswith(f"{home1.public_ip}:")
        assert symmetric[1].startswith(f"{home1.public_ip}:")
        assert symmetric[0] != symmetric[1]
    assert not {n for n in _namespaces() if n.startswith(prefix)}
