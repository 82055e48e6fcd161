"""Announced prefix names are salted with a mesh-private key (issue 45, item 8): a
reader without the mesh secret cannot confirm a prompt from a stage's summary."""

from __future__ import annotations

import torch

from hetmesh.discovery.host import derive_psk
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.prefix import block_hashes, scoped
from hetmesh.scheduler.prefix_summary import (
    decode_summary,
    encode_summary,
    matched_blocks,
    salted,
    summary_salt,
    truncate,
)

PROMPT = list(range(200, 264))  # four full blocks
HASHES = block_hashes(PROMPT)
GATEWAY = "12D3KooWgateway"


def names_for(hashes: list[int], gateway: str, salt: bytes) -> list[int]:
    """What a gateway matches (``RouteChooser.summary_names``)."""
    return salted(scoped(hashes, gateway), salt)


def test_the_salt_comes_from_the_mesh_secret() -> None:
    assert summary_salt(derive_psk("one secret")) == summary_salt(derive_psk("one secret"))
    assert summary_salt(derive_psk("one secret")) != summary_salt(derive_psk("another"))
    assert len(summary_salt(derive_psk(None))) == 32


def test_a_summary_confirms_a_prompt_only_with_the_meshs_key() -> None:
    salt = summary_salt(derive_psk("mesh secret"))
    cached = scoped(HASHES, GATEWAY)  # the names a stage's cache holds for them
    summary = decode_summary(encode_summary(salted(cached, salt)))
    # the gateway (and any member) matches its request
    assert matched_blocks(names_for(HASHES, GATEWAY, salt), summary) == 4
    # without the secret: neither the prompt's hashes nor its scoped names confirm it
    assert matched_blocks(HASHES, summary) == 0
    assert matched_blocks(cached, summary) == 0
    outsider = summary_salt(derive_psk("a guess"))
    assert matched_blocks(names_for(HASHES, GATEWAY, outsider), summary) == 0
    assert not {truncate(h) for h in HASHES + cached} & summary


def test_a_stage_announces_its_pools_names_salted() -> None:
    """What ``StageHost.prefix_summaries`` announces: the pool's names, salted."""
    pool = KVPool(
        num_blocks=8,
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv = SessionKV(owner=0, pool=pool, max_length=64)
    kv.scope = GATEWAY
    assert kv.reserve(len(PROMPT))
    kv._commit(len(PROMPT))
    kv.publish(HASHES)
    salt = summary_salt(derive_psk("mesh secret"))
    summary = decode_summary(encode_summary(salted(pool.prefix.recent_hashes(16), salt)))
    assert matched_blocks(names_for(HASHES, GATEWAY, salt), summary) == 4
    assert matched_blocks(HASHES, summary) == 0
