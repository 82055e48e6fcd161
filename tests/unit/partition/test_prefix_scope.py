"""Whose prefix-cache blocks are shared with whom (issue 45, item 2): one gateway's
sessions only, and never KV another peer computed (plain pools, no model)."""

from __future__ import annotations

import torch

from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.prefix import block_hashes, scoped

PROMPT = list(range(100, 140))  # two full blocks and a tail
HASHES = block_hashes(PROMPT)


def pool() -> KVPool:
    return KVPool(
        num_blocks=8,
        num_layers=2,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def session(p: KVPool, scope: str) -> SessionKV:
    kv = SessionKV(owner=0, pool=p, max_length=64)
    kv.scope = scope
    return kv


def computed(kv: SessionKV, tokens: int) -> None:
    """As a forward would: ``tokens`` positions written and committed."""
    assert kv.reserve(kv.length + tokens)
    shape = (kv.pool.kv_heads, tokens, kv.pool.head_dim)
    for layer in range(kv.pool.num_layers):
        kv._write(layer, torch.ones(shape), torch.ones(shape))
    kv._commit(tokens)


def test_scoped_names_differ_between_gateways_and_stay_below_2_63() -> None:
    a, b = scoped(HASHES, "gateway-a"), scoped(HASHES, "gateway-b")
    assert a == scoped(HASHES, "gateway-a")  # deterministic
    assert not set(a) & set(b)
    assert not set(a) & set(HASHES)
    assert all(0 <= n < 2**63 for n in a + b)


def test_a_block_is_found_by_its_own_gateways_sessions_only() -> None:
    p = pool()
    writer = session(p, "gateway-a")
    computed(writer, len(PROMPT))
    writer.publish(HASHES)
    writer.free()
    assert p.cached_blocks == 2
    other = session(p, "gateway-b")
    assert other.attach(HASHES, len(PROMPT) - 1) == 0  # another gateway's: not shared
    other.free()
    same = session(p, "gateway-a")
    assert same.attach(HASHES, len(PROMPT) - 1) == 32
    same.free()


def test_migrated_kv_is_never_named_in_the_prefix_cache() -> None:
    p = pool()
    shape = (2, 2, len(PROMPT), 4)
    kv = session(p, "gateway-a")
    kv.load(torch.zeros(shape), torch.zeros(shape))  # another peer's word for the prompt
    computed(kv, 1)
    kv.publish(block_hashes([*PROMPT, 7]))
    assert p.cached_blocks == 0
    kv.free()
    assert session(p, "gateway-a").attach(HASHES, len(PROMPT) - 1) == 0
