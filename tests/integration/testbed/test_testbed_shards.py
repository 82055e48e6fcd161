"""Weights over the mesh on emulated hosts: only one host ever had the model.

Three ``hetmesh node start`` processes in their own namespaces (hetmesh/testbed):
host 0 holds the converted default model; hosts 1 and 2 start with ``--model
mesh`` and empty caches. Each offers too little memory for the model alone, so
the plan uses all three. Host 1 fetches its stages' tensors over direct
data-plane links (TCP between namespaces); host 2 offers only libp2p (a spec
that asks for it), so its links and its fetches take the libp2p fallback. The
generation equals the single-process reference, and each joiner's cache holds
the tensors of its stages' units and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetmesh.partition.store import SHARD_TENSORS
from hetmesh.shards.manifest import load_or_build, tensors_for_units
from hetmesh.testbed.mesh import HostSpec, MakeTestbed, plan_of, wait_for
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(420),
]

PROMPT_IDS = [1, 504, 3458, 282, 1029, 314, 253]
NEW_TOKENS = 8
# float32: 350 MiB hosts must split it (the default model's own int4 fits one)
NODE_ARGS = (
    *("--max-sessions", "2", "--max-context", "256", "--block-step-ms", "2"),
    *("--weights", "float32"),
)


def _peer(view: dict[str, Any], peer_id: str) -> dict[str, Any]:
    (peer,) = [p for p in view["peers"] if p["peer_id"] == peer_id]
    return peer


def test_testbed_mesh_serves_a_model_only_one_host_had(
    mesh_testbed: MakeTestbed, default_model_dir: Path, tmp_path: Path
) -> None:
    expected = reference_ids(default_model_dir, PROMPT_IDS, NEW_TOKENS, "float32")
    manifest = load_or_build(default_model_dir)
    caches = {h: tmp_path / f"cache{h}" for h in (1, 2)}
    joiner = ("--model", "mesh")
    bed = mesh_testbed(
        [
            HostSpec(max_memory="350MiB"),
            HostSpec(max_memory="350MiB", args=(*joiner, "--cache-dir", str(caches[1]))),
            # host 2 offers only libp2p: its links, and its fetches, take the fallback
            HostSpec(
                max_memory="350MiB",
                args=(*joiner, "--cache-dir", str(caches[2])),
                backends=("libp2p",),
            ),
        ]
    )
    bed.start_all(*NODE_ARGS)
    view = bed.wait_serving()
    (got,) = bed.generate(PROMPT_IDS, NEW_TOKENS)
    assert "error" not in got, got
    assert got["tokens"] == expected

    plan = plan_of(view)
    assert plan is not None
    hosts = bed.peer_host()
    stages = {
        h: [(s.start, s.end) for s in plan.pipelines[0].stages if hosts[s.peer_id] == h]
        for h in (0, 1, 2)
    }
    assert all(stages[h] for h in (0, 1, 2)), stages  # no host could serve alone
    for h in (1, 2):
        wanted = {t.name for a, b in stages[h] for t in tensors_for_units(manifest, a, b)}
        (folder,) = caches[h].glob(f"models/shards/{manifest.id}/*")
        assert {p.name for p in (folder / SHARD_TENSORS).iterdir()} == wanted
        # host 1's bytes all came over a direct link, host 2's all over libp2p; the
        # counters reach status with the next announcement
        peer_id = next(n.peer_id for n in bed.nodes if n.host == h)
        need = sum(manifest.tensor(n).nbytes for n in wanted)

        def counted(peer_id: str = peer_id, need: int = need) -> dict[str, Any] | None:
            shards = _peer(bed.status(), peer_id)["record"]["extra"]["shards"]
            return shards if shards.get("bytes_fetched", 0) >= need else None

        shards = wait_for(counted, 60, f"host {h}'s shard counters in status", every_s=1.0)
        assert shards["bytes_fetched"] == need
        assert shards["bytes_direct"] == (need if h == 1 else 0)
        assert shards["verification_failures"] == 0
    logs = {n.host: n.log() for n in bed.nodes}
    assert "tcp: direct TCP endpoint offered" in logs[1]
    assert "libp2p: encrypted control stream" in logs[2]
    assert "tcp: direct" not in logs[2]
