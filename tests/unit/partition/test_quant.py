"""int8/int4 layers: packing round trips, kernels against their own dequantised weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hetmesh.partition import quant
from hetmesh.partition.quant import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    pack_int4,
    quantize_groups_int4,
    quantize_rows_int8,
    unpack_int4,
)


@pytest.mark.parametrize(("n", "k"), [(64, 32), (128, 96), (192, 576)])
def test_int4_pack_round_trips(n: int, k: int) -> None:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (96, 64), (576, 192)])
def test_int4_linear_multiplies_by_its_q4_1_weights(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, d, m = quantize_groups_int4(w)
    exact = (q.float().reshape(n, -1, 32) * d[..., None] + m[..., None]).reshape(n, k)
    assert (exact - w).abs().max() <= d.max() / 2 + 1e-6  # rounding to the nearest level
    layer = Int4Linear(k, n, bias=True, device="cpu")
    packed, scales_zeros = Int4Linear.pack(q, d, m)
    layer.weight_packed.copy_(packed)
    layer.scales_zeros.copy_(scales_zeros)
    assert layer.bias is not None
    layer.bias.data.normal_(generator=gen)
    x = torch.randn(9, k, generator=gen)
    expected = x @ exact.t() + layer.bias
    got = layer(x)
    # bf16 activations, scales and zero points inside the kernel
    assert float((got - expected).abs().max() / expected.abs().max()) < 0.01
    assert torch.equal(layer(x[4:5]), got[4:5])  # rows do not depend on each other
    # the 4-bit levels are the Q4_1 ones; only the bf16 scales and zeros round
    assert float((layer.dequantized() - exact).abs().max() / exact.abs().max()) < 0.01


def test_int8_linear_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen)
    layer = Int8Linear(64, 96, bias=False, device="cpu")
    q, scale = quantize_rows_int8(w)
    layer.weight_q.copy_(q)
    layer.weight_scale.copy_(scale)
    x = torch.randn(2, 20, 64, generator=gen)
    batched = layer(x)
    assert batched.shape == (2, 20, 96)
    assert torch.equal(layer(x[1, 7:8]), batched[1, 7:8])  # padded to 17 rows inside
    reference = x @ w.t()
    assert float((batched - reference).abs().max() / reference.abs().max()) < 0.03


def test_int8_embedding_rows() -> None:
    w = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    table = Int8Embedding(50, 16, device="cpu")
    q, scale = quantize_rows_int8(w)
    table.weight_q.copy_(q)
    table.weight_scale.copy_(scale)
    ids = torch.tensor([[3, 49], [0, 3]])
    out = table(ids)
    assert out.shape == (2, 2, 16)
    assert torch.equal(out[0, 0], out[1, 1])
    assert torch.allclose(out, w[ids], atol=float(scale.max()) / 2 + 1e-6)


_LAYOUT_CHECK = """
import torch
from hetmesh.partition.quant import Int4Linear, int4_layout_name, pack_int4, quantize_groups_int4
from hetmesh.partition.quant import unpack_int4
q = torch.randint(0, 16, (192, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
assert torch.equal(unpack_int4(pack_int4(q)), q)
w = torch.randn(80, 64, generator=torch.Generator().manual_seed(4))
layer = Int4Linear(64, 80, bias=False, device="cpu")
packed, scales_zeros = Int4Linear.pack(*quantize_groups_int4(w))
layer.weight_packed.copy_(packed)
layer.scales_zeros.copy_(scales_zeros)
x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
# the kernel multiplies by exactly the matrix dequantized() reads out of its packing
reference = x.bfloat16().float() @ layer.dequantized().t()
assert float((layer(x) - reference).abs().max() / reference.abs().max()) < 0.02
print(torch.backends.cpu.get_cpu_capability(), int4_layout_name())
"""


# torch's CPU capabilities, lowest first (``ATEN_CPU_CAPABILITY`` names)
_CAPABILITIES = ("default", "avx2", "avx512")


@pytest.mark.parametrize(
    ("capability", "layout"),
    [("avx512", "halves of 64"), ("avx2", "halves of 32"), ("default", "pairs in 32")],
)
def test_int4_packing_is_read_back_on_every_cpu_capability(capability: str, layout: str) -> None:
    """torch packs int4 by the CPU's vector width (CI once ran on an AVX2 machine
    where the AVX-512 layout was assumed); each capability this CPU has is checked.
    One it lacks is not forced: on an AVX2-only CPU torch obeys ``avx512`` and dies
    of SIGILL (seen on an AMD EPYC) rather than falling back."""
    ours = torch.backends.cpu.get_cpu_capability().lower()
    if _CAPABILITIES.index(capability) > _CAPABILITIES.index(ours):
        pytest.skip(f"this CPU runs {ours}, below {capability}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", _LAYOUT_CHECK], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    got_capability, got_layout = done.stdout.split(maxsplit=1)
    assert got_capability.lower() == capability
    assert got_layout.strip() == layout


@pytest.mark.parametrize(
    ("m", "k", "n"), [(2, 576, 1536), (1, 1536, 576), (40, 2100, 70), (17, 64, 3000)]
)
def test_int8_sums_in_float32_equal_int_mm_bit_for_bit(m: int, k: int, n: int) -> None:
    """The fp32 path (CPUs where ``_int_mm`` is slow) must give ``_int_mm``'s exact
    sums, at the extremes of int8 and past the 1,024 inputs one fp32 chunk holds."""
    seeded = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=seeded)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=seeded)
    a[-1], w[-1] = -127, 127  # the most negative sum
    a[0], w[0] = 127, 127  # the largest: k * 127 * 127
    by_int_mm = quant._sums_by_int_mm(a, w)
    assert by_int_mm[0, 0] == torch.tensor(k * 127 * 127, dtype=torch.int32).float()
    assert torch.equal(quant._sums_in_float32(a, w), by_int_mm)


def test_int8_linear_gives_the_same_bits_by_either_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(300, 1536, generator=torch.Generator().manual_seed(6))
    layer = Int8Linear(1536, 300, bias=False, device="cpu")
    q, scale = quantize_rows_int8(w)
    layer.weight_q.copy_(q)
    layer.weight_scale.copy_(scale)
    x = torch.randn(3, 5, 1536, generator=torch.Generator().manual_seed(7))
    outs = {}
    for kernel in ("int_mm", "float32"):
        monkeypatch.setenv("HETMESH_INT8_KERNEL", kernel)
        quant.int8_kernel.cache_clear()
        assert quant.int8_kernel() == kernel
        outs[kernel] = layer(x)
    quant.int8_kernel.cache_clear()
    assert torch.equal(outs["int_mm"], outs["float32"])


def test_int8_head_in_bf16_multiplies_by_its_rows_and_keeps_rows_independent() -> None:
    """The int4 format's head (on CPUs with native bf16): weight-only int8 with bf16
    activations, close to the exact product of its int8 rows, and a row's logits
    never depend on its batch."""
    gen = torch.Generator().manual_seed(3)
    n, k = 1000, 576
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    layer = Int8Linear(k, n, bias=False, device="cpu", bf16_activations=True)
    layer.weight_q.copy_(q)
    layer.weight_scale.copy_(scale)
    x = torch.randn(9, k, generator=gen)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    got = layer(x)
    assert got.dtype == torch.float32
    assert got.shape == (9, n)
    # bf16 activations and sums: ~2**-8 relative, far below int8's own rounding
    error = ((got.double() - exact).abs().max() / exact.abs().max()).item()
    assert 0 < error < 0.02
    for row in range(9):
        assert torch.equal(layer(x[row : row + 1])[0], got[row])


@pytest.mark.parametrize("forced", ["1", "0"])
def test_the_int4_head_takes_bf16_where_the_cpu_has_it(
    monkeypatch: pytest.MonkeyPatch, forced: str
) -> None:
    from hetmesh.partition.formats import BF16_HEAD_ENV, bf16_int8_head, cpu_has_bf16

    assert bf16_int8_head() is cpu_has_bf16()  # the CPU's flags, unless forced
    monkeypatch.setenv(BF16_HEAD_ENV, forced)
    assert bf16_int8_head() is (forced == "1")


_needs_packed = pytest.mark.skipif(
    not quant.packed_int8_exact(), reason="no exact oneDNN int8 product on this CPU"
)


@_needs_packed
@pytest.mark.parametrize("k", [64, 512, 576, 960])
@pytest.mark.parametrize("m", [1, 2, 17, 600])
def test_packed_int8_sums_are_exact_at_the_extremes(
    monkeypatch: pytest.MonkeyPatch, m: int, k: int
) -> None:
    """oneDNN's product of a packed matrix gives int8_sums' bits: rows and columns of
    ±127 (pair sums past 16 bits), rows just under the bound its sums stay exact
    below (odd sums near 2**24), and calls with a row past it, which take int8_sums."""
    gen = torch.Generator().manual_seed(m * 7 + k)
    n = 160
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    w[0], w[1] = 127, -127
    w[2] = torch.randint(115, 128, (k,), dtype=torch.int8, generator=gen)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    # as near the bound as this width allows: 127 * sum(a + 128) just under 2**24
    near = min(116, (2**24 - 1) // (127 * k) - 128 - 12)
    a[0] = torch.randint(near, near + 12, (k,), dtype=torch.int8, generator=gen)
    if m > 1:
        a[1] = -127
    fallbacks = []
    real = quant.int8_sums
    monkeypatch.setattr(quant, "int8_sums", lambda *args: fallbacks.append(1) or real(*args))
    packed = quant._pack_for_onednn(w)
    got = quant._sums_packed(a, packed, w)
    assert not fallbacks  # oneDNN's own sums
    assert torch.equal(got, quant._sums_in_float32(a, w))
    assert torch.equal(got, (a.double() @ w.double().t()).float())
    if 127 * 255 * k >= 2**24:  # a row of +127s: past the bound, int8_sums for the call
        a[-1] = 127
        past = quant._sums_packed(a, packed, w)
        assert fallbacks
        assert torch.equal(past, (a.double() @ w.double().t()).float())


@_needs_packed
def test_packed_head_gives_the_w8a8_bits_and_keeps_rows_independent() -> None:
    """An LM head with ``packed``: W8A8 (the int8 format's head) bit for bit, whatever
    its rows' batch (1-600 rows)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 3000, 576
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    heads = []
    for packed in (True, False):
        layer = Int8Linear(k, n, bias=False, device="cpu", bf16_activations=True, packed=packed)
        layer.weight_q.copy_(q)
        layer.weight_scale.copy_(scale)
        heads.append(layer)
    packed_head, bf16_head = heads
    w8a8 = Int8Linear(k, n, bias=False, device="cpu")
    w8a8.weight_q.copy_(q)
    w8a8.weight_scale.copy_(scale)
    x = torch.randn(600, k, generator=gen)
    x[3, 7] = 40.0  # an outlier (the second pass's case)
    got = packed_head(x)
    assert packed_head._packed is not None  # the packed kernel ran
    assert torch.equal(got, w8a8(x))
    assert not torch.equal(got[:4], bf16_head(x[:4]))  # not the bf16 head's numerics
    for rows in (slice(0, 1), slice(3, 5), slice(7, 24), slice(100, 400)):
        assert torch.equal(packed_head(x[rows]), got[rows])


def test_packed_head_switch_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant.PACKED_HEAD_ENV, "0")
    quant.packed_int8_exact.cache_clear()
    try:
        assert not quant.packed_int8_exact()
        layer = Int8Linear(64, 96, bias=False, device="cpu", packed=True)
        layer.weight_q.zero_()
        layer.weight_scale.fill_(1.0)
        layer(torch.randn(2, 64))
        assert layer._packed is None  # int8_sums, not the packed copy
    finally:
        monkeypatch.delenv(quant.PACKED_HEAD_ENV)
        quant.packed_int8_exact.cache_clear()
