"""How the suite is split across pytest-xdist workers (``-n`` in pyproject.toml's addopts).

Most of the suite's time is spent waiting: node processes starting, a model loading,
liveness and calibration intervals. Several workers overlap those waits, and on a machine
loaded by other work they also win the suite a larger share of the CPU.

- **A test file is the unit of work** (``--dist loadfile``), run whole on one worker, so
  a module-scoped mesh starts once, never once per worker.
- **Files that build network namespaces share a lane** and run one after another on one
  worker: the testbed lane (cgroup limits and ``tc`` shaping, whose measured bounds
  should not compete with a second testbed) and the LAN lane (mDNS and peers between
  namespaces). The controller knows a test by its id only, so a file joins a lane when
  its text applies the ``netns`` marker.
- **Files that share one mesh run back to back** on one worker
  (:data:`SHARED_MESH_FILES`, tests/integration/shared_mesh.py), in that order, so
  its nodes start once; without xdist they are moved next to each other too.
- **The heaviest files are handed out first**: the lanes, then files that start
  processes or load the model, then other slow ones, then the rest, so a long file never
  starts last. Each file's own order is kept.

``-n auto`` (addopts) means :data:`WORKERS` workers, or none under ``--pdb``; ``-n 0``
runs the suite in one process, and then nothing here applies.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from functools import cache
from pathlib import Path
from typing import Any

import pytest

# xdist workers for `-n auto` (addopts), unless PYTEST_XDIST_AUTO_NUM_WORKERS says. Two:
# each worker may be starting a mesh of node processes; every test must stay correct at
# half its CPU share. Three were measured (docs/benchmarks.md, "Suite stability"): under
# two busy loops pytest took 939 and 996 s with three, 930 s with two in a clean run, and
# three brought more timing failures (each hardened since); two stay.
WORKERS = 2
HEAVY_MARKERS = ("multiprocess", "model")
# test files whose namespaces carry cgroup limits or tc shaping (paths under tests/)
TESTBED_FILES = ("integration/testbed/", "integration/discovery/test_netns_helper.py")
# test files (paths under tests/) that use one shared three-node mesh, in the order they run:
# the API's first (the daemon's hostile-member test leaves a stranger in the nodes' views)
SHARED_MESH_FILES = ("integration/api/test_api_mesh.py", "integration/node/test_mesh_serving.py")
SHARED_MESH_LANE = "shared-mesh3"
# ``pytestmark = [..., pytest.mark.netns, ...]`` or ``@pytest.mark.netns`` on a test
MODULE_MARKS = re.compile(r"^pytestmark\s*=\s*(\[[^\]]*\]|.*)$", re.MULTILINE)
TEST_NETNS_MARK = re.compile(r"^\s*@pytest\.mark\.netns\b", re.MULTILINE)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def applies_netns(text: str) -> bool:
    """Whether a test file's source marks its module or one of its tests ``netns``."""
    module = MODULE_MARKS.search(text)
    return bool(module and "mark.netns" in module.group(1)) or bool(TEST_NETNS_MARK.search(text))


def lane_of(path: str, netns: bool) -> str:
    """The work unit of a test file: the file itself, or a shared lane (netns, one mesh)."""
    if shared_slot(path) is not None:
        return SHARED_MESH_LANE
    if not netns:
        return path
    if any(part in path for part in TESTBED_FILES):
        return "netns-testbed"
    return "netns-lan"


def shared_slot(path: str) -> int | None:
    """The place of ``path`` in :data:`SHARED_MESH_FILES`, or None."""
    for index, name in enumerate(SHARED_MESH_FILES):
        if path.endswith(name):
            return index
    return None


def rank_of(markers: set[str]) -> int:
    """Lower runs first: netns files, process/model files, other slow files, the rest."""
    if "netns" in markers:
        return 0
    if markers.intersection(HEAVY_MARKERS):
        return 1
    if "slow" in markers:
        return 2
    return 3


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """:data:`WORKERS`, whatever the core count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own rule reads it
    return WORKERS


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: order the files heaviest kind first (xdist hands them out in this order).

    Everywhere: the files of :data:`SHARED_MESH_FILES` next to each other, in that order.
    """
    markers: dict[str, set[str]] = defaultdict(set)
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        path = file_of(item.nodeid)
        markers[path].update(m.name for m in item.iter_markers())
        first_seen.setdefault(path, index)
    shared = [first_seen[p] for p in first_seen if shared_slot(p) is not None]

    def place(path: str) -> tuple[int, int]:
        slot = shared_slot(path)
        return (first_seen[path], 0) if slot is None else (min(shared), slot)

    if not hasattr(config, "workerinput"):  # not an xdist worker: collection order
        items.sort(key=lambda item: place(file_of(item.nodeid)))
        return
    for path, names in markers.items():
        # the controller puts netns files in a lane by their text: it must see each one
        if "netns" in names and not applies_netns((config.rootpath / path).read_text()):
            raise pytest.UsageError(
                f"{path}: mark netns tests with `pytestmark = [pytest.mark.netns, ...]` or "
                "`@pytest.mark.netns` (tests/scheduling.py runs such files one at a time)"
            )
    items.sort(
        key=lambda item: (rank_of(markers[file_of(item.nodeid)]), *place(file_of(item.nodeid)))
    )


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the netns files of each lane as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)

    @cache
    def netns_file(path: str) -> bool:
        try:
            return applies_netns((root / path).read_text())
        except OSError:
            return False

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = file_of(nodeid)
            return lane_of(path, netns_file(path))

    return LaneScheduling(config, log)
