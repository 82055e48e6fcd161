"""The exact fp32 kernel: a few rows summed in MKL's own order (issue 44, item 5).

Shapes are the default model's (SmolLM2-135M: hidden 576, MLP 1,536, k/v 192, the
head 49,152 x 576) and the tiny test model's (hidden 64, MLP 96), random weights."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetmesh.partition import exact_kernel as ek
from hetmesh.partition.exact_linear import make_exact

DEFAULT_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in)
TINY_SHAPES = [(64, 64), (32, 64), (96, 64), (64, 96)]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe again in this test (the process's verdict kept around it)."""
    monkeypatch.setattr(ek, "_BLOCK", None)
    monkeypatch.setattr(ek, "_LIB", None)
    monkeypatch.setattr(ek, "ROWS", ek.KERNEL_ROWS)
    monkeypatch.delenv("HETMESH_EXACT_KERNEL", raising=False)


def _block() -> int:
    block = ek.kernel_block()
    if not block:
        pytest.skip("the kernel does not hold on this machine (no compiler, or another order)")
    return block


def _weight(out: int, inp: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) / inp**0.5


@pytest.mark.parametrize(("out", "inp"), DEFAULT_SHAPES + TINY_SHAPES)
def test_a_few_rows_by_the_kernel_get_the_bits_of_a_large_f_linear_call(out: int, inp: int) -> None:
    """1 to 8 rows by the kernel equal the same rows of a 12-, 16- and 512-row
    ``F.linear`` call (the head: 12 and 16), for every shape of the default and the
    tiny model, the weight whole and sliced by outputs."""
    block = _block()
    w = _weight(out, inp)
    x = torch.randn(512 if out < 8192 else 16, inp, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for calls in (12, 16, x.shape[0]):
            ref = F.linear(x[:calls], w)
            for m in range(1, ek.KERNEL_ROWS + 1):
                assert torch.equal(ek.kernel_rows(x[:m], w, block), ref[:m]), (calls, m)
        part = w[out // 4 : out // 4 + max(16, out // 4)]  # a slice of a larger weight
        assert torch.equal(ek.kernel_rows(x[3:8], part, block), F.linear(x[:16], part)[3:8])


def test_the_kernel_is_not_torchs_lone_row() -> None:
    """The kernel's bits are a large call's, not torch's 1-row kernel's (which differ
    on this EPYC: the reason for the kernel)."""
    block = _block()
    w = _weight(1536, 576)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = torch.cat([ek.kernel_rows(row[None], w, block) for row in x])
        torchs = torch.cat([F.linear(row[None], w) for row in x])
        assert torch.equal(ours, F.linear(x, w))
    if torch.equal(torchs, ours):
        pytest.skip("torch's lone row has a large call's bits here too")


def test_make_exact_takes_the_kernel_for_a_few_rows_and_mkl_for_more() -> None:
    """make_exact's fp32 layers compute up to KERNEL_ROWS rows by the kernel (the lean
    path's lone row too, bias added after as the padded way did), and every call's rows
    equal a 16-row call's."""
    block = _block()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536, bias=False), nn.Linear(1536, 576))
    make_exact(model)
    assert [m.kernel for m in model] == [block, block]
    assert "by the kernel" in repr(model)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        lin = model[1]
        ref = F.linear(x[:16], lin.weight) + lin.bias
        assert all(torch.equal(lin(x[i]), ref[i]) for i in range(16))  # lean path
        assert all(torch.equal(lin(x[i : i + 1]), ref[i : i + 1]) for i in range(16))
        for m in range(1, 17):
            assert torch.equal(lin(x[:m]), ref[:m]), m
        assert torch.equal(lin(x)[:16], ref)


def test_make_exact_refuses_the_kernel_for_a_shape_whose_order_differs() -> None:
    """MKL sums a call of 8 outputs its own way (not the kernel's): make_exact's probe
    per shape then takes F.linear padded for that layer, still exact, and the kernel for
    the others."""
    block = _block()
    w = _weight(8, 576)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        differs = not torch.equal(ek.kernel_rows(x[:8], w, block), F.linear(x, w)[:8])
    model = nn.Sequential(nn.Linear(576, 8, bias=False), nn.Linear(8, 576, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    make_exact(model)
    if not differs:
        pytest.skip("MKL sums 8 outputs in the kernel's order here")
    assert model[0].kernel == 0
    with torch.inference_mode():
        ref = model[0](x)
        assert all(torch.equal(model[0](x[i]), ref[i]) for i in range(16))


def test_the_kernel_is_built_once_into_the_cache(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library is built under the cache dir, named by its source, compiler and CPU,
    and reused: a second probe builds nothing."""
    monkeypatch.setenv("HETMESH_HOME", str(tmp_path))
    block = _block()
    built = list((tmp_path / "kernels").glob("exact_kernel-*.so"))
    assert len(built) == 1
    assert built[0] == ek.library_path()
    stamp = built[0].stat().st_mtime_ns
    ek.reset()
    assert ek.kernel_block() == block
    assert built[0].stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built[0].name]  # no temp


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "/bin/false"])
def test_no_compiler_means_the_padded_way_not_a_crash(
    fresh: None,
    cc: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No compiler (a missing path) or a failing one: the probe says so once in the log,
    and make_exact's layers pad a lone row as before, still exact."""
    monkeypatch.setenv("HETMESH_HOME", str(tmp_path))
    monkeypatch.setenv("HETMESH_CC", cc)
    with caplog.at_level(logging.WARNING, logger="hetmesh.partition.exact_kernel"):
        assert ek.kernel_block() == 0
        assert ek.kernel_block() == 0
    assert len([r for r in caplog.records if "not built" in r.message]) == 1
    model = nn.Sequential(nn.Linear(576, 576, bias=False))
    make_exact(model)
    assert model[0].kernel == 0
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        ref = model(x)
        assert torch.equal(model(x[3]), ref[3])
        if model[0].quantum:
            assert torch.equal(ref, F.linear(x, model[0].weight))
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_the_switch_turns_the_kernel_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_EXACT_KERNEL", "0")
    assert ek.kernel_block() == 0
    model = nn.Sequential(nn.Linear(64, 96, bias=False))
    make_exact(model)
    assert model[0].kernel == 0


@pytest.mark.parametrize(("flags", "width"), [("-mno-avx512f", 8), ("-mno-avx512f -mno-avx2", 1)])
def test_the_avx2_and_plain_c_kernels_sum_in_the_same_order(
    fresh: None, flags: str, width: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built without AVX-512 (a compiler wrapper adding -mno-avx512f: the AVX2 path) or
    without AVX2 too (the plain C loop), the kernel gives the vector one's bits: the
    order is the source's, not the ISA's. The plain loop is no faster than padding:
    the probe refuses it (a lone row padded), said in the log."""
    native = _block()
    ek.reset()
    wrapper = tmp_path / "cc-narrow"
    wrapper.write_text(f'#!/bin/sh\nexec cc "$@" {flags}\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("HETMESH_HOME", str(tmp_path))
    monkeypatch.setenv("HETMESH_CC", str(wrapper))
    block = ek.kernel_block()
    assert ek._load().hm_width() == width
    assert (block in ek.BLOCKS) if width > 1 else block == 0
    rows = 4 if width == 8 else ek.KERNEL_ROWS  # AVX2: one pass, 4 rows
    assert rows == ek.ROWS
    w = _weight(96, 700)
    x = torch.randn(16, 700, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        ref = F.linear(x, w)
        for m in (1, 3, 5, 8):
            assert torch.equal(ek.kernel_rows(x[:m], w, block or native), ref[:m]), m
    assert os.path.exists(ek.library_path())


@pytest.mark.parametrize("kind", ["llama-tied", "mistral-window"])
def test_a_tiny_stages_decode_steps_equal_its_prefill_and_the_padded_way(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 stage of the tiny model takes the kernel for its few rows: its decode
    steps equal the same rows in a prefill (whole and chunked), and the very bits of
    the same stage with the kernel off (a lone row padded to 4), where F.linear's way
    holds."""
    from hetmesh.partition.exact_linear import ExactLinear
    from hetmesh.partition.formats import WeightFormat
    from hetmesh.partition.stage import load_stage
    from tests.unit.partition.invariance import alone_and_in_a_round, decoded_and_replayed
    from tests.unit.partition.tiny_models import save_tiny

    block = _block()
    save_tiny(kind, tmp_path)
    stage = load_stage(tmp_path, 0, 6, weights=WeightFormat.FLOAT32)
    layers = [m for m in stage.modules() if isinstance(m, ExactLinear)]
    if not any(m.quantum for m in layers):
        pytest.skip("F.linear's way does not hold here (another CPU's classes)")
    assert [m.kernel for m in layers if m.quantum] == [block] * sum(1 for m in layers if m.quantum)
    with torch.inference_mode():
        decoded, replayed, chunked = decoded_and_replayed(stage, 20, 10)
        assert torch.equal(decoded, replayed)
        assert torch.equal(decoded, chunked)
        alone, rounded, beside, _ = alone_and_in_a_round(stage, [30, 47, 3, 16])
        assert torch.equal(alone, rounded)
        assert torch.equal(alone, beside)
        for m in layers:
            m.kernel = 0
        padded, _, _ = decoded_and_replayed(stage, 20, 10)
    assert torch.equal(decoded, padded)
