"""How tests/scheduling.py splits the suite across xdist workers (pure parts, no workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduling import SHARED_MESH_FILES, applies_netns, lane_of, rank_of, shared_slot

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]\n", True),
        ("pytestmark = [\n    pytest.mark.slow,\n    pytest.mark.netns,\n]\n", True),
        ("pytestmark = pytest.mark.netns\n", True),
        ("@pytest.mark.netns\ndef test_x() -> None: ...\n", True),
        ("    @pytest.mark.netns\n    def test_x(self) -> None: ...\n", True),
        ("pytestmark = [pytest.mark.slow]\n", False),
        # the marker as data (the time-limit table), not applied to a test
        ("CASES = [((pytest.mark.netns,), 600.0)]\n", False),
        ("pytestmark = [pytest.mark.slow]\nCASES = [(pytest.mark.netns,)]\n", False),
    ],
)
def test_applies_netns_reads_the_module_and_test_marks(text: str, expected: bool) -> None:
    assert applies_netns(text) is expected


def test_lanes_group_netns_files_and_keep_other_files_alone() -> None:
    assert lane_of("tests/unit/test_x.py", False) == "tests/unit/test_x.py"
    assert lane_of("tests/integration/testbed/test_testbed_mesh.py", True) == "netns-testbed"
    assert lane_of("tests/integration/discovery/test_netns_helper.py", True) == "netns-testbed"
    assert lane_of("tests/integration/discovery/test_mesh_netns.py", True) == "netns-lan"
    assert lane_of("tests/integration/api/test_sdk_mdns.py", True) == "netns-lan"


def test_the_files_of_one_shared_mesh_share_a_lane_in_a_fixed_order() -> None:
    api = "tests/integration/api/test_api_mesh.py"
    daemon = "tests/integration/node/test_mesh_serving.py"
    assert lane_of(api, False) == lane_of(daemon, False) == "shared-mesh3"
    assert (shared_slot(api), shared_slot(daemon)) == (0, 1)
    assert shared_slot("tests/integration/node/test_mesh_faults.py") is None
    for name in SHARED_MESH_FILES:  # each still exists and asks for the shared mesh
        assert "shared_mesh3" in (ROOT / "tests" / name).read_text()


def test_rank_puts_netns_then_processes_then_slow_then_the_rest() -> None:
    ranks = [
        rank_of({"netns", "slow"}),
        rank_of({"multiprocess"}),
        rank_of({"model", "slow"}),
        rank_of({"slow"}),
        rank_of({"parametrize"}),
    ]
    assert ranks == [0, 1, 1, 2, 3]


def test_the_repository_netns_files_are_all_in_a_lane() -> None:
    laned = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if applies_netns(path.read_text())
    }
    assert {
        "tests/integration/testbed/test_testbed_mesh.py",
        "tests/integration/discovery/test_mesh_netns.py",
        "tests/integration/transport/test_sealed_netns.py",
    } <= laned
    assert "tests/unit/test_time_limits.py" not in laned
