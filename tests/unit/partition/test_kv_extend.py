"""A session's next block taken from another thread (``SessionKV.extend``): only free
blocks, never a cached one, and never a block two sessions hold, with real threads."""

from __future__ import annotations

import threading

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.prefix import block_hashes
from tests.unit.partition.test_prefix import pool as new_pool


def _session(pool: KVPool) -> SessionKV:
    return SessionKV(owner=0, pool=pool, max_length=1 << 20)


def test_extend_takes_the_next_free_block_in_one_run() -> None:
    pool = new_pool(4)
    kv = _session(pool)
    assert kv.reserve(16)
    assert kv.extend(16)  # held already: nothing taken
    assert kv.blocks == [0]
    assert kv.extend(17)
    assert kv.blocks == [0, 1]
    assert kv.contiguous
    assert pool.free_blocks == 2


def test_extend_never_evicts_a_cached_block_nor_grows_a_privatepool() -> None:
    pool = new_pool(2)
    writer = _session(pool)
    assert writer.reserve(32)
    writer._commit(32)  # its two blocks' tokens (a forward writes, then commits)
    writer.publish(block_hashes(list(range(32))))
    writer.free()  # both blocks stay cached, idle: free to reserve, not to extend
    assert pool.free_blocks == 2
    kv = _session(pool)
    assert not kv.extend(1)
    assert kv.blocks == []
    assert pool.cached_blocks == 2
    assert kv.reserve(1)  # the owner's reserve evicts the least recently used one
    assert len(kv.blocks) == 1
    private = KVPool(
        num_blocks=0,
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        growable=True,
    )
    lone = _session(private)
    assert not lone.extend(1)
    assert private.num_blocks == 0
    assert lone.reserve(1)


def test_extend_on_a_freed_session_is_refused() -> None:
    kv = _session(new_pool(2))
    kv.free()
    with pytest.raises(InvalidRequest, match="freed"):
        kv.extend(1)


def test_extends_on_other_threads_and_the_owners_takes_never_share_a_block() -> None:
    pool = new_pool(4096)
    rounds = 300
    grown: list[SessionKV] = []
    start = threading.Barrier(3)

    def extender() -> None:
        kv = _session(pool)
        grown.append(kv)
        start.wait()
        for i in range(rounds):
            assert kv.extend(16 * (i + 1))

    threads = [threading.Thread(target=extender) for _ in range(2)]
    for thread in threads:
        thread.start()
    start.wait()
    owned = []
    for _ in range(rounds):  # the owner's thread opens, grows and frees sessions meanwhile
        kv = _session(pool)
        assert kv.reserve(48)
        owned.append(kv)
        if len(owned) > 3:
            owned.pop(0).free()
    for thread in threads:
        thread.join(60)
    held = [b for kv in [*grown, *owned] for b in kv.blocks]
    assert all(len(kv.blocks) == rounds for kv in grown)
    assert len(held) == len(set(held))  # no block held twice
    assert pool.free_blocks == 4096 - len(held)
