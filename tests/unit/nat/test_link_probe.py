"""The link prober's kinds as data: which path a peer's link is probed over, and how each
kind reads its answerer's clock (pure; the probes themselves: test_punch, test_probe)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetmesh.discovery.probe import LIBP2P_PROBE, PUNCHED_PROBE, TCP_PROBE
from hetmesh.nat.link_probe import LinkProber
from hetmesh.nat.state import NatState


def test_a_punched_peer_is_probed_over_its_punched_path_first() -> None:
    nat = NatState(public_ip="203.0.113.5")
    prober = LinkProber(SimpleNamespace(), nat)  # type: ignore[arg-type]
    assert prober.kinds("P") == (LIBP2P_PROBE,)
    is_open = {"P": True}
    nat.note_punched("P", lambda: is_open["P"])
    assert prober.kinds("P") == (PUNCHED_PROBE, LIBP2P_PROBE)
    assert prober.kinds("Q") == (LIBP2P_PROBE,)
    is_open["P"] = False  # the punched link closed: back to the libp2p connection
    assert prober.kinds("P") == (LIBP2P_PROBE,)


def test_only_a_user_space_clock_is_capped_by_the_askers_figure() -> None:
    """A late receiver over a stream times 3 MiB in 0.1 s of a 4 MiB transfer that took
    the asker 0.32 s: the stream kind reports the asker's figure, the socket kinds (kernel
    arrival times) the tail."""
    nbytes = 4 << 20
    assert LIBP2P_PROBE.bandwidth(nbytes, 0.1, 0.32, 0.01) == pytest.approx(nbytes / 0.32)
    tail = (nbytes - nbytes // 4) / 0.1
    assert PUNCHED_PROBE.bandwidth(nbytes, 0.1, 0.32, 0.01) == pytest.approx(tail)
    assert TCP_PROBE.bandwidth(nbytes, 0.1, 0.32, 0.01) == pytest.approx(tail)
    # no tail timed: the whole transfer less the round trip the acknowledgement took
    assert TCP_PROBE.bandwidth(100, 0.0, 0.02, 0.01) == pytest.approx(100 / 0.01)
    assert {k.name for k in (TCP_PROBE, LIBP2P_PROBE, PUNCHED_PROBE)} == {
        "tcp",
        "libp2p",
        "punched",
    }
