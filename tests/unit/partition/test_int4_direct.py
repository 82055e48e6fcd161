"""torch's int4 layout built from Q4_1 bytes equals torch's own packer, byte for byte."""

from __future__ import annotations

import pytest
import torch

from hetmesh.partition.int4_direct import pack_q4_1_into, scales_zeros
from hetmesh.partition.quant import Int4Linear


def _q4_1(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1 rows: bytes ``(n, k/2)``, ``d`` and ``m`` fp16 ``(n, k/32)``."""
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    m = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
    return qs, d, m


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """One byte a weight, in input order (the file's low nibbles, then its high ones)."""
    n, half = qs.shape
    blocks = qs.reshape(n, half // 16, 16)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)


@pytest.mark.parametrize(("n", "k"), [(64, 32), (128, 576), (192, 1536)])
def test_packed_bytes_equal_torchs_packer(n: int, k: int) -> None:
    qs, d, m = _q4_1(n, k, seed=n + k)
    expected, expected_sz = Int4Linear.pack(_nibbles(qs), d.float(), m.float())
    out = torch.empty_like(qs)
    pack_q4_1_into(qs, out)
    assert torch.equal(out, expected)
    assert torch.equal(scales_zeros(d, m), expected_sz)


def test_packs_into_a_slice_of_rows_of_a_larger_matrix() -> None:
    qs, _, _ = _q4_1(256, 64, seed=1)
    whole = torch.full((320, 32), 0xAB, dtype=torch.uint8)
    pack_q4_1_into(qs[64:192], whole[64:192])
    expected, _ = Int4Linear.pack(_nibbles(qs[64:192]), torch.ones(128, 2), torch.zeros(128, 2))
    assert torch.equal(whole[64:192], expected)
    assert bool((whole[:64] == 0xAB).all())
    assert bool((whole[192:] == 0xAB).all())


def test_q8_0_blocks_into_int8_equal_quantizing_their_dequantised_rows() -> None:
    from hetmesh.partition.materialise import q8_0_into_int8
    from hetmesh.partition.quant import quantize_rows_int8

    gen = torch.Generator().manual_seed(5)
    qs = torch.randint(-128, 128, (7, 96), generator=gen, dtype=torch.int8)
    d = (torch.randn(7, 3, generator=gen) * 0.01).half()
    d[1, 2] = -d[1, 2].abs() - 0.5  # a negative scale: the row's largest |w| is there
    qs[2] = 0  # an all-zero row: its scale is the floor
    d[3] = 0.0
    qs[4, 40] = -128  # -128 has no int8 absolute value: read through fp32
    d[4, 1] = 1.0
    w = (qs.float().reshape(7, 3, 32) * d.float()[..., None]).reshape(7, 96)  # reader.rows
    expected_q, expected_scale = quantize_rows_int8(w)
    q = torch.empty(7, 96, dtype=torch.int8)
    scale = torch.empty(7)
    q8_0_into_int8(qs, d, q, scale)
    assert torch.equal(q, expected_q)
    assert torch.equal(scale, expected_scale)
    assert q[4, 40] == -127


@pytest.mark.parametrize("layout", ["halves of 64", "halves of 32", "pairs in 32", "pairs in 64"])
def test_every_layout_follows_its_definition(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CPU layout torch may pick (only this CPU's can be compared with torch's
    packer): block ``b``'s packed row for input ``i`` holds, in byte ``j``, the weight of
    row ``lo(j)`` in its low nibble and of ``hi(j)`` in its high one."""
    from hetmesh.partition import int4_direct

    monkeypatch.setattr(int4_direct, "int4_layout_name", lambda: layout)
    halves, block = int4_direct._LAYOUTS[layout]
    n, k = 128, 96
    qs, _, _ = _q4_1(n, k, seed=7)
    out = torch.empty_like(qs)
    pack_q4_1_into(qs, out)
    w = _nibbles(qs).view(n // block, block, k)
    j = torch.arange(block // 2)
    lo, hi = (j, j + block // 2) if halves else (2 * j, 2 * j + 1)
    expected = (w[:, lo] | (w[:, hi] << 4)).transpose(1, 2)  # (blocks, k, block / 2)
    assert torch.equal(out.view(n // block, k, block // 2), expected)


def test_partial_blocks_are_refused() -> None:
    qs, _, _ = _q4_1(64, 64, seed=2)
    with pytest.raises(ValueError, match="whole blocks"):
        pack_q4_1_into(qs[:32], torch.empty_like(qs[:32]))
    with pytest.raises(ValueError, match="contiguous uint8"):
        pack_q4_1_into(qs, torch.empty((64, 16), dtype=torch.uint8))


def test_int8_rows_in_place_equal_quantize_rows_int8() -> None:
    from hetmesh.partition.materialise import rows_into_int8
    from hetmesh.partition.quant import quantize_rows_int8

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(9, 300, generator=gen) * torch.rand(9, 1, generator=gen)
    w[4] = 0.0  # an all-zero row: its scale is the floor
    w[5, 7] = -50.0  # a row whose largest magnitude is negative
    expected_q, expected_scale = quantize_rows_int8(w)
    q = torch.empty(9, 300, dtype=torch.int8)
    scale = torch.empty(9)
    rows_into_int8(w.clone(), q, scale)
    assert torch.equal(q, expected_q)
    assert torch.equal(scale, expected_scale)


@pytest.mark.parametrize("layout", ["halves of 64", "halves of 32", "pairs in 32", "pairs in 64"])
def test_packed_nibbles_read_back_as_q4_1_bytes(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's nibbles stored packed in any layout give back Q4_1's bytes."""
    from hetmesh.partition import int4_direct

    qs, _, _ = _q4_1(128, 96, seed=9)
    out = torch.empty_like(qs)
    with monkeypatch.context() as patched:
        patched.setattr(int4_direct, "int4_layout_name", lambda: layout)
        pack_q4_1_into(qs, out)
        assert int4_direct.packed_suffix().startswith(".q4_1.int4")
    assert not torch.equal(out, qs)
    assert torch.equal(int4_direct.q4_1_from_packed(out, layout), qs)
