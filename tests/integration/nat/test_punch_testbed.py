"""Hole punching through the NAT testbed's routers: cone homes meet, a symmetric one does not.

One topology (three homes, home 2 behind a symmetric router, 100 Mbit/s
uplinks), no node processes: each side runs hetmesh.nat.punch's
simultaneous open from a fixed local port towards the other router at that
port (the candidate a port-preserving router gives), on one shared clock.
"""

from __future__ import annotations

import secrets

import pytest

from hetmesh.testbed.nat import nat_unavailable_reason, open_nat_testbed, try_punch

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]


def test_punch_meets_through_cone_routers_and_fails_through_a_symmetric_one() -> None:
    reason = nat_unavailable_reason(need_tc=True)
    if reason:
        pytest.skip(reason)
    port = 40000 + secrets.randbelow(20000)
    with open_nat_testbed(3, symmetric={2}, rate="100mbit") as bed:
        home0, home1, home2 = bed.homes
        sent, got = try_punch(bed, home0, home1, port=port, nbytes=1 << 20)
        # a direct connection: each side sees the other's router at the punched port
        assert sent["ok"], sent
        assert got["ok"], got
        assert sent["peer"] == [home1.public_ip, port]
        assert got["peer"] == [home0.public_ip, port]
        assert got["received"] == 1 << 20
        # home 2's router maps the port to a random one: the SYNs never meet
        sent, got = try_punch(bed, home0, home2, port=port + 1)
        assert not sent["ok"], sent
        assert not got["ok"], got
