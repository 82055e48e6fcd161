"""A node that joined through bootstrap and reaches no member any more says so, once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio

from hetmesh.nat.dialback import Reachability
from hetmesh.nat.reachability import no_member_advice

BOOT = ("/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWBoot",)


def _said(caplog: pytest.LogCaptureFixture) -> int:
    return sum("reaches no member" in r.getMessage() for r in caplog.records)


async def test_alone_after_bootstrap_warns_once_until_members_return(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hetmesh.nat.dialback")
    discovery = SimpleNamespace(config=SimpleNamespace(bootstrap=BOOT), peer_id="me")
    reach = Reachability(discovery)  # type: ignore[arg-type]
    reach.alone_after_s = 10.0  # virtual time stays under the test's time limit
    reach._check_alone(0)
    await trio.sleep(reach.alone_after_s - 1)
    reach._check_alone(0)
    assert _said(caplog) == 0  # not yet: members may be restarting
    await trio.sleep(2)
    reach._check_alone(0)
    reach._check_alone(0)
    assert _said(caplog) == 1
    reach._check_alone(2)  # members again: a later loss is reported afresh
    reach._check_alone(0)
    await trio.sleep(reach.alone_after_s + 1)
    reach._check_alone(0)
    assert _said(caplog) == 2


async def test_a_first_node_without_bootstrap_is_not_alone(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    discovery = SimpleNamespace(config=SimpleNamespace(bootstrap=()), peer_id="me")
    reach = Reachability(discovery)  # type: ignore[arg-type]
    reach.alone_after_s = 10.0
    reach._check_alone(0)
    await trio.sleep(reach.alone_after_s * 3)
    reach._check_alone(0)
    assert _said(caplog) == 0


def test_no_member_advice_names_the_bootstrap_and_what_to_do() -> None:
    line = no_member_advice(BOOT)
    assert BOOT[0] in line
    assert "mesh secret" in line
    assert "public address" in line
