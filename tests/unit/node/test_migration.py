"""KV migration's pure parts: pairing routes, checking a received frame, export/load
of a session's blocks, and the control messages (no sockets, no model)."""

from __future__ import annotations

import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.node.control import MoveSession, OpenSession, parse_request
from hetmesh.node.gateway import Hop
from hetmesh.node.migration import check_kv, kv_frame, moves
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.protocol.generate import SamplingParams
from hetmesh.transport.frames import KVBlock

A = (Hop("a", 0, 10), Hop("b", 10, 20), Hop("c", 20, 30))


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        (A, None),  # nothing moves
        ((Hop("a", 0, 10), Hop("x", 10, 20), Hop("c", 20, 30)), [(1, "b", "x")]),
        (
            (Hop("y", 0, 10), Hop("b", 10, 20), Hop("z", 20, 30)),
            [(0, "a", "y"), (2, "c", "z")],
        ),
        ((Hop("a", 0, 15), Hop("x", 15, 30)), None),  # cut differently: replay
        ((Hop("a", 0, 12), Hop("x", 12, 20), Hop("c", 20, 30)), None),
        ((), None),
    ],
)
def test_moves_pairs_stages_of_the_same_units_only(new, expected):
    assert moves(A, new) == expected


def pool(blocks: int = 8, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(
        num_blocks=blocks,
        num_layers=2,
        kv_heads=3,
        head_dim=4,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def write(kv: SessionKV, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``tokens`` positions of distinct values, as forwards would; returns them
    as ``(layers, kv_heads, tokens, head_dim)`` keys and values."""
    p = kv.pool
    assert kv.reserve(kv.length + tokens)
    g = torch.Generator().manual_seed(seed)
    shape = (p.num_layers, p.kv_heads, tokens, p.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    for layer in range(p.num_layers):
        kv._write(layer, keys[layer], values[layer])
    kv._commit(tokens)
    return keys, values


@pytest.mark.parametrize("fragmented", [False, True])
def test_export_then_load_moves_the_filled_part_exactly(fragmented):
    source_pool, target_pool = pool(), pool()
    source = SessionKV(owner=0, pool=source_pool, max_length=128)
    keys, values = write(source, 16, 1)  # block 0
    if fragmented:  # another session takes block 1: the source's next block is not adjacent
        write(SessionKV(owner=0, pool=source_pool, max_length=128), 16, 2)
    more_keys, more_values = write(source, 21, 3)
    assert source.contiguous is not fragmented
    expected = torch.cat([keys, more_keys], 2), torch.cat([values, more_values], 2)
    sent = source.export()
    assert sent[0].shape == sent[1].shape == (2, 3, 37, 4)
    assert all(t.is_contiguous() for t in sent)
    assert torch.equal(sent[0], expected[0])
    assert torch.equal(sent[1], expected[1])
    target = SessionKV(owner=1, pool=target_pool, max_length=128)
    target.load(*sent)
    assert target.length == 37
    assert torch.equal(target.export()[0], expected[0])
    assert torch.equal(target.export()[1], expected[1])
    free_before = target_pool.free_blocks
    target.free()
    assert target_pool.free_blocks == free_before + 3 == target_pool.num_blocks


def test_export_sends_only_the_filled_part_not_the_whole_blocks():
    kv = SessionKV(owner=0, pool=pool(), max_length=128)
    write(kv, 17, 5)  # two blocks held, 17 tokens filled
    keys, _ = kv.export()
    assert keys.shape[2] == 17
    assert keys.nbytes == kv.used_bytes // 2


def test_load_refuses_a_session_that_already_holds_tokens():
    kv = SessionKV(owner=0, pool=pool(), max_length=128)
    write(kv, 5, 6)
    keys, values = kv.export()
    with pytest.raises(InvalidRequest):
        kv.load(keys, values)


def frame(tokens: int = 20, dtype: torch.dtype = torch.float32, **changes) -> KVBlock:
    keys = torch.zeros((2, 3, tokens, 4), dtype=dtype)
    block = kv_frame("s1", keys, keys.clone())
    fields = {
        "session_id": block.session_id,
        "first_layer": block.first_layer,
        "start": block.start,
        "tensors": block.tensors,
    } | changes
    return KVBlock(**fields)


GOOD = {"num_layers": 2, "kv_heads": 3, "head_dim": 4, "dtype": torch.float32, "length": 20}


def test_check_kv_takes_a_frame_that_fits():
    keys, values = check_kv(frame(), **GOOD)
    assert keys.shape == values.shape == (2, 3, 20, 4)


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (frame(tokens=19), "shape"),  # fewer tokens than admitted
        (frame(dtype=torch.bfloat16), "dtype"),
        (frame(first_layer=1), "layer"),
        (frame(start=16), "position"),
        (frame(tensors=(torch.zeros((2, 3, 20, 4)),)), "tensors"),
        (frame(tensors=(torch.zeros((3, 3, 20, 4)),) * 2), "shape"),
        (frame(tensors=(torch.zeros((2, 3, 20, 5)),) * 2), "shape"),
    ],
)
def test_check_kv_refuses_what_does_not_fit_and_says_what(bad, named):
    with pytest.raises(InvalidRequest, match=named if named != "dtype" else "bfloat16"):
        check_kv(bad, **GOOD)


def test_move_and_migrating_open_round_trip_through_the_wire():
    move = MoveSession(session_id="s", kv_to="peer-b", next_peer="c", previous_peer="a")
    assert parse_request(move.to_wire()) == move
    relink = MoveSession(session_id="s", next_peer="c", previous_peer="a")
    assert parse_request(relink.to_wire()) == relink
    open_ = OpenSession(
        session_id="s",
        start=0,
        end=4,
        next_peer="c",
        gateway="g",
        max_tokens=64,
        prompt_tokens=40,
        sampling=SamplingParams(seed=3),
        migrate_from="peer-a",
    )
    assert parse_request(open_.to_wire()) == open_
    old_peer = open_.to_wire()
    del old_peer["migrate_from"]  # a peer from before migrations: a plain open
    assert parse_request(old_peer).migrate_from == ""


def test_migrations_and_their_bytes_are_counted_and_announced():
    from hetmesh.node.kvcache import KVLimits, KVManager, kv_counters

    p = pool()
    limits = KVLimits(max_sessions=4, max_tokens_per_session=128, budget_bytes=1)
    manager = KVManager(limits, pool=p, factory=lambda: SessionKV(owner=0, pool=p, max_length=128))
    manager.note_migration_in(1000)
    manager.note_migration_in(24)
    manager.note_migration_out()
    counters = kv_counters(manager.statistics())
    assert counters["kv_migrations"] == 2
    assert counters["kv_migrated_bytes"] == 1024
    assert counters["kv_migrations_out"] == 1
