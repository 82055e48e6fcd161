"""Float linear layers whose rows do not depend on the call's other rows (issue 44).

The shapes are the default model's (SmolLM2-135M: hidden 576, MLP 1,536, k/v 192,
vocabulary 49,152; the fp32 head column-major as load_stage stores it), with
random weights: the kernels' choices follow shapes, not values."""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetmesh.partition import exact_kernel
from hetmesh.partition import exact_linear as el
from hetmesh.partition.exact_linear import ExactLinear, exact_linear, make_exact

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (out, in)


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        return ""


# The kernels' classes below were measured on Intel's Xeon; AMD's EPYC (Zen 4, the same
# MKL and oneDNN) draws them elsewhere, and the probe takes another way there
XEON = _cpu_vendor() == "GenuineIntel"


def _quanta_hold(w: torch.Tensor, tile: int = el.FLOAT32_PACKED_TILE) -> bool:
    """Whether fp32's ``F.linear`` in calls of 12 rows or more or a multiple of 4 holds
    for ``w`` (AMD's EPYC), the way make_exact tries first."""
    return el.tiles_are_exact(w, None, tile, *el.QUANTA)


@pytest.fixture
def _no_quanta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe refuses the F.linear way (which AMD's EPYC takes first), so make_exact
    goes on to the packed ones."""
    probe = el.tiles_are_exact

    def no_quanta(*a: Any, **kw: Any) -> bool:
        return not (kw.get("quantum") or (len(a) > 5 and a[5])) and probe(*a, **kw)

    monkeypatch.setattr(el, "tiles_are_exact", no_quanta)


@pytest.fixture
def _packed_ways(_no_quanta: None) -> None:
    """For the tests of make_exact's packed fp32 ways: skipped where none holds (AMD's
    EPYC, whose packed product holds only in calls of 4 rows or more: the F.linear way
    is taken there, with no copy)."""
    w = _weight(576, 576, torch.float32)
    packed = el.mkl_pack(w)
    if packed is None or not el.tiles_are_exact(w, packed, el.FLOAT32_PACKED_TILE):
        assert not XEON
        pytest.skip("no packed way of make_exact holds on this CPU (F.linear's is taken)")


@pytest.mark.parametrize(("out", "inp"), [*SHAPES, (49152, 576)])
def test_float32_linear_calls_of_12_rows_or_a_multiple_of_4_share_one_class(
    out: int, inp: int
) -> None:
    """AMD's EPYC: MKL's ``F.linear`` computes rows in blocks of 4 and, in a call of
    fewer than 12 rows, a block's 1 to 3 leftover rows by other kernels (at 1 thread
    only a call of 1 to 3 rows; the reproduction: a 2-row call differs from its rows
    padded to 4), the same bits at 1 and 2 threads; every call of 12 rows or more, or
    of a multiple of 4, gives a row one result. So calls padded to that take the
    weight as stored: no packed copy. (Intel's Xeon draws the classes at 2 and 16
    rows: the probe refuses it there.)"""
    w = _weight(out, inp, torch.float32)
    if out == 49152:
        w = w.t().contiguous().t()  # column-major, as load_stage stores an fp32 head
    tile = el.FLOAT32_PACKED_TILE if out < 49152 else el.LARGE_TILE
    if not _quanta_hold(w, tile):
        assert XEON, "F.linear's calls of 12 or a multiple of 4 hold on AMD's EPYC"
        pytest.skip("F.linear's classes differ on this CPU: a packed way is taken")
    x = _rows(300 if out < 49152 else 60, inp, torch.float32)
    pad = torch.zeros(3, inp)
    alone = torch.cat([F.linear(torch.cat((row, pad)), w)[:1] for row in x.split(1)])
    assert not torch.equal(F.linear(x[:2], w), alone[:2])  # the reproduction
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (4, 8, 12, 13, 17, 31, 33, 60, 129, 257, 300):
                if m <= len(x):
                    assert torch.equal(F.linear(x[:m], w), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)
    kw = {"tile": tile, "least": el.LINEAR_LEAST, "quantum": el.LINEAR_QUANTUM}
    rng = random.Random(out + inp)
    for _ in range(12):
        lo = rng.randrange(0, len(x) - 1)
        hi = rng.randrange(lo + 1, len(x) + 1)
        assert torch.equal(exact_linear(x[lo:hi], w, None, **kw), alone[lo:hi]), (lo, hi)  # type: ignore[arg-type]


def test_make_exact_takes_float32_linear_as_stored_where_its_calls_hold() -> None:
    """Where the F.linear way holds (AMD's EPYC) make_exact takes it before any packed
    one: the weight keeps its bytes and no copy is made (a packed copy there took ~1.7x
    the weight's bytes, uncharged, and an 800 MiB host was killed); a lone row's lean
    path (padded to 4 rows), a round, a chunk and a prefill give a row the same bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576, bias=False))
    if not _quanta_hold(model[1].weight.detach()):
        pytest.skip("F.linear's classes differ on this CPU: a packed way is taken")
    x = _rows(300, 576, torch.float32)
    with torch.no_grad():
        want = model(x)
        assert make_exact(model) == 0
        assert all(m.packed is None and m.quantum == 4 and m.least == 12 for m in model)
        assert all(m.tile == el.QUANTA_TILE for m in model)  # a 300-row prefill: one call
        assert model[0].weight.untyped_storage().nbytes() == 576 * 1536 * 4
        assert "a multiple of 4" in repr(model[0])
        got = model(x)
        alone = torch.stack([model(row) for row in x])  # (576,): the lean path
        assert torch.equal(got, alone)
        for lo, hi in ((0, 1), (3, 8), (5, 6), (10, 23), (0, 11), (7, 264)):
            assert torch.equal(model(x[lo:hi]), alone[lo:hi]), (lo, hi)
        assert torch.equal(model(x[9:10].view(1, 1, 576)), alone[9].view(1, 1, 576))
        # past the tile: tiles of 512 and the rest, the same bits as each row alone
        longer = torch.cat((x, _rows(300, 576, torch.float32, seed=2)))
        assert torch.equal(model(longer)[300:], torch.stack([model(r) for r in longer[300:]]))
    with torch.inference_mode():
        assert torch.equal(model(x[4:5]), alone[4:5])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not any(row.any() for row in el._ZERO_ROWS.values())  # the padding stays zero


def _f32_least(w: torch.Tensor, packed: torch.Tensor, tile: int) -> int:
    """The fewest rows of fp32's packed calls the probe proves (as make_exact takes it):
    2 on Intel's Xeon, 4 on AMD's EPYC (1 to 3 rows take other kernels there)."""
    least = next((n for n in (2, 4) if el.tiles_are_exact(w, packed, tile, least=n)), 0)
    assert least, "no packed way holds for this shape"
    return least


def _skip_unless_lone_calls_hold(w: torch.Tensor, packed: torch.Tensor, tile: int) -> None:
    if not XEON and not el.tiles_are_exact(w, packed, tile, lone=True):
        pytest.skip("a lone row's 1-row call holds on Intel's Xeon; padded rows here")


DTYPES = [torch.float32, torch.bfloat16]


def _weight(out: int, inp: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g).to(dtype)


def _rows(n: int, width: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(dtype)


def _alone(weight: torch.Tensor, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    return torch.cat([exact_linear(row, weight, None, **kw) for row in x.split(1)])


def test_torch_linear_rows_depend_on_the_call() -> None:
    """The reproduction: torch's own products give a row other sums in a larger call."""
    differs = []
    for out, inp in SHAPES:
        for dtype, rows in ((torch.float32, 16), (torch.bfloat16, 340)):
            w, x = _weight(out, inp, dtype), _rows(rows, inp, dtype)
            alone = torch.cat([F.linear(row, w) for row in x.split(1)])
            differs.append(not torch.equal(F.linear(x, w), alone))
    assert any(differs)
    assert all(differs[0::2])  # fp32: 1 row and 16 rows never share a kernel here


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_rows_equal_their_lone_result_in_any_call(out: int, inp: int, dtype: torch.dtype) -> None:
    w = _weight(out, inp, dtype)
    if not XEON and not el.tiles_are_exact(w):
        pytest.skip("row tiles hold on Intel's Xeon; the probe takes another way here")
    assert el.tiles_are_exact(w)  # this machine takes the tiled path for these shapes
    x = _rows(360, inp, dtype)
    alone = _alone(w, x)
    rng = random.Random(out * inp)
    for _ in range(25):
        lo = rng.randrange(0, 359)
        hi = rng.randrange(lo + 1, 361)
        assert torch.equal(exact_linear(x[lo:hi], w, None), alone[lo:hi]), (lo, hi)
    # a batch of padded rows (batch, seq, hidden) is its rows
    assert torch.equal(exact_linear(x[:40].view(4, 10, inp), w, None), alone[:40].view(4, 10, -1))
    assert torch.allclose(alone.float(), F.linear(x, w).float(), rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_heads_rows_equal_their_lone_result(dtype: torch.dtype) -> None:
    w = _weight(49152, 576, dtype)
    if dtype is torch.float32:
        w = w.t().contiguous().t()  # column-major, as load_stage stores an fp32 head
    if not XEON and not el.tiles_are_exact(w):
        pytest.skip("row tiles hold on Intel's Xeon; the probe takes another way here")
    assert el.tiles_are_exact(w)
    x = _rows(40, 576, dtype)
    alone = _alone(w, x)
    for lo, hi in ((0, 40), (3, 20), (5, 6), (7, 9), (1, 33)):
        assert torch.equal(exact_linear(x[lo:hi], w, None), alone[lo:hi])


def test_float32_tiles_hold_2_to_15_rows() -> None:
    for rows in range(2, 200):
        tiles = el._float32_tiles(rows)
        assert sum(tiles) == rows
        assert all(2 <= t <= el.FLOAT32_TILE for t in tiles)


def _layers(dtype: torch.dtype, bias: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=bias), nn.Linear(96, 64, bias=bias)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_shape_whose_tiles_fail_the_probe_computes_one_row_per_call(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(el, "tiles_are_exact", lambda *a, **kw: False)
    model = _layers(dtype, bias=True)
    before = model.state_dict()
    assert make_exact(model) == 2
    assert all(isinstance(m, ExactLinear) and not m.tiled for m in model)
    assert model.state_dict().keys() == before.keys()
    x = _rows(50, 64, dtype)
    with torch.no_grad():
        alone = torch.cat([model(row) for row in x.split(1)])
        for lo, hi in ((0, 50), (4, 21), (10, 11)):
            assert torch.equal(model(x[lo:hi]), alone[lo:hi])


@pytest.mark.parametrize("lone", [False, True])
@pytest.mark.parametrize(("out", "inp"), [*SHAPES, (49152, 576)])
def test_float32_packed_rows_equal_their_lone_result_in_any_call(
    out: int, inp: int, lone: bool
) -> None:
    """MKL's packed product: one class for every call of 2 rows or more and for a
    1-row call (``lone``; else the lone row padded to 2) on Intel's Xeon, for every
    call of 4 rows or more on AMD's EPYC (fewer padded to 4); calls of up to 256 rows
    (the head's: 32), so 600 rows cross tiles."""
    w = _weight(out, inp, torch.float32)
    if out == 49152:
        w = w.t().contiguous().t()  # column-major, as load_stage stores an fp32 head
    packed = el.mkl_pack(w)
    assert packed is not None  # this torch has MKL's packed product
    tile = el.FLOAT32_PACKED_TILE if out < 49152 else el.LARGE_TILE
    if lone:
        _skip_unless_lone_calls_hold(w, packed, tile)
    least = _f32_least(w, packed, tile)
    assert el.tiles_are_exact(w, packed, tile, lone=lone, least=least)
    n = 600 if out < 49152 else 70
    x = _rows(n, inp, torch.float32)
    kw = {"packed": packed, "tile": tile, "lone": lone, "least": least}
    alone = _alone(w, x, **kw)  # type: ignore[arg-type]
    rng = random.Random(out + inp)
    for _ in range(12):
        lo = rng.randrange(0, n - 1)
        hi = rng.randrange(lo + 1, n + 1)
        got = exact_linear(x[lo:hi], w, None, **kw)  # type: ignore[arg-type]
        assert torch.equal(got, alone[lo:hi]), (lo, hi)
    assert torch.allclose(alone, F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("_packed_ways")
def test_make_exact_packs_float32_and_frees_the_weight_unless_shared() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576), nn.Linear(576, 1536))
    model[2].weight = model[0].weight  # tied: another module's bytes
    x = _rows(300, 576, torch.float32)
    with torch.no_grad():
        want = model(x)
        assert make_exact(model) == 0
        assert all(isinstance(m, ExactLinear) and m.packed is not None for m in model)
        # freed: one element stands for the weight; the tied one keeps its bytes
        assert model[1].weight.untyped_storage().nbytes() == 4
        assert model[1].weight.shape == (576, 1536)
        assert model[0].weight.untyped_storage().nbytes() == 576 * 1536 * 4
        got = model(x)
        alone = torch.cat([model(row) for row in x.split(1)])
    assert torch.equal(got, alone)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    plain = nn.Sequential(nn.Linear(576, 576))
    make_exact(plain, packed=False)
    assert plain[0].packed is None
    assert plain[0].tiled or not XEON  # EPYC: F.linear tiles of 2-15 fail, one row per call


@pytest.mark.parametrize("lone", [False, True])
@pytest.mark.usefixtures("_packed_ways")
def test_a_lone_rows_lean_path_equals_the_row_in_any_call(lone: bool) -> None:
    """A decode step's lone row skips exact_linear's reshapes (ExactLinear.forward):
    the same packed call (on the row alone, or the row and a zero row), so the same
    bits as the row in a call of many, in every shape of a lone row, in and out of
    inference mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536, bias=False), nn.Linear(1536, 576, bias=False))
    make_exact(model)
    assert all(isinstance(m, ExactLinear) and m.packed is not None for m in model)
    if lone and not all(m.lone for m in model):  # the probe proved the 1-row call here?
        assert not XEON
        pytest.skip("a lone row's 1-row call holds on Intel's Xeon; padded rows here")
    for m in model:
        m.lone = lone
    x = _rows(9, 576, torch.float32)
    with torch.no_grad():
        many = model(x)
        for n in range(9):
            assert torch.equal(model(x[n]), many[n])  # (576,)
            assert torch.equal(model(x[n : n + 1].view(1, 1, 576)), many[n].view(1, 1, 576))
            lin = model[0]
            general = exact_linear(
                x[n : n + 1], lin.weight, None, packed=lin.packed, lone=lone, least=lin.least
            )
            assert torch.equal(lin(x[n : n + 1]), general)
    with torch.inference_mode():
        assert torch.equal(model(x[4:5]), many[4:5])
    assert not any(row.any() for row in el._ZERO_ROWS.values())  # the padding stays zero


@pytest.mark.usefixtures("_packed_ways")
def test_a_lone_row_is_padded_where_the_1_row_call_fails_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where MKL's 1-row packed call is a class of its own (another CPU or MKL), the
    probe refuses it and the layer pads a lone row to 2, still packed."""
    probe = el.tiles_are_exact

    def no_lone(
        w: torch.Tensor,
        packed: torch.Tensor | None = None,
        tile: int = 256,
        lone: bool = False,
        least: int = 2,
    ) -> bool:
        return not lone and probe(w, packed, tile, least=least)

    monkeypatch.setattr(el, "tiles_are_exact", no_lone)
    model = nn.Sequential(nn.Linear(576, 576, bias=False))
    make_exact(model)
    assert model[0].packed is not None
    assert not model[0].lone
    x = _rows(5, 576, torch.float32)
    with torch.no_grad():
        assert torch.equal(model(x[2]), model(x)[2])


@pytest.mark.usefixtures("_packed_ways")
def test_a_freed_weight_stays_on_the_cpu_while_another_stage_builds_its_skeleton() -> None:
    """accelerate's init_empty_weights patches register_parameter for the whole process
    while a stage's skeleton is built (another node's load, in an in-process mesh): a
    placeholder registered through it then landed on meta, and the stage's next step
    failed ('weight type (MetaFloatType)'), seen in a loaded suite run."""
    from accelerate import init_empty_weights

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96))
    x = _rows(5, 64, torch.float32)
    with torch.no_grad():
        want = model(x)
        if model[0].weight.device.type != "cpu" or el.mkl_pack(model[0].weight) is None:
            pytest.skip("no MKL packed product in this torch build")
        with init_empty_weights():  # as another thread's skeleton build leaves it
            make_exact(model)
        assert model[0].packed is not None
        assert model[0].weight.device.type == "cpu"
        got = model(x)
        assert torch.equal(got, torch.cat([model(row) for row in x.split(1)]))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("_no_quanta")
def test_a_packing_that_fails_the_probe_falls_back_to_row_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe checks the packed product against the weight itself: a packing of
    other numbers (or one whose call read the placeholder) is not taken."""
    other = el.mkl_pack(_weight(192, 576, torch.float32, seed=9))
    monkeypatch.setattr(el, "mkl_pack", lambda weight: other)
    model = nn.Sequential(nn.Linear(576, 192))
    assert make_exact(model) == (0 if model[0].tiled else 1)
    assert model[0].packed is None
    assert model[0].tiled or not XEON  # row tiles on Intel's Xeon, one row per call on EPYC
    assert model[0].weight.untyped_storage().nbytes() == 576 * 192 * 4


def test_make_exact_leaves_other_modules_and_dtypes_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8).half(), nn.Embedding(10, 8), nn.Linear(8, 8))
    make_exact(model)
    assert type(model[0]) is nn.Linear  # fp16: not a format tiled here
    assert type(model[1]) is nn.Embedding
    assert isinstance(model[2], ExactLinear)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_is_added_after_the_product(dtype: torch.dtype) -> None:
    model = _layers(dtype, bias=True)
    x = _rows(30, 64, dtype)
    with torch.no_grad():
        want = model[0](x)
        make_exact(model)
        got = model[0](x)
        alone = torch.cat([model[0](row) for row in x.split(1)])
    assert torch.equal(got, alone)
    assert torch.allclose(got.float(), want.float(), rtol=0.02, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_float32_packed_calls_of_every_row_count_share_one_class(out: int, inp: int) -> None:
    """The probe at load checks some call sizes; here every size a call can have
    (2, or 4 on AMD's EPYC, to the tile of 256 rows) gives each row its lone result,
    for the default model's shapes."""
    w = _weight(out, inp, torch.float32)
    packed = el.mkl_pack(w)
    assert packed is not None
    least = _f32_least(w, packed, el.FLOAT32_PACKED_TILE)
    x = _rows(el.FLOAT32_PACKED_TILE, inp, torch.float32)
    alone = _alone(w, x, packed=packed, least=least)  # type: ignore[arg-type]
    mm = torch.ops.mkl._mkl_linear.default
    differ = [
        m
        for m in range(least, el.FLOAT32_PACKED_TILE + 1)
        if not torch.equal(mm(x[:m], packed, w, None, m), alone[:m])
    ]
    assert differ == []
    # and a 1-row call (a lone row not padded) gives each row the same bits (Xeon) or
    # not (EPYC: the reproduction for padding to 4)
    ones = [
        not torch.equal(mm(x[i : i + 1], packed, w, None, 1), alone[i : i + 1]) for i in range(16)
    ]
    assert any(ones) == (least > 2)


def test_a_lone_rows_1_row_call_gives_the_same_bits_at_1_and_2_threads() -> None:
    """A node's torch threads need not be the reference process's: a decode step's
    1-row packed call, and the same row in a call of many, give the same bits at 1
    and 2 threads."""
    w = _weight(1536, 576, torch.float32)
    packed = el.mkl_pack(w)
    assert packed is not None
    lone = el.tiles_are_exact(w, packed, el.FLOAT32_PACKED_TILE, lone=True)
    least = 2 if lone else _f32_least(w, packed, el.FLOAT32_PACKED_TILE)  # EPYC: padded
    x = _rows(12, 576, torch.float32)
    before = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = (
                _alone(w, x, packed=packed, lone=lone, least=least),  # type: ignore[arg-type]
                exact_linear(x, w, None, packed=packed, lone=lone, least=least),
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1][0], got[2][0])
    assert torch.equal(got[1][1], got[2][1])
    assert torch.equal(got[1][0], got[1][1])


def _bf16_way(w: torch.Tensor, packed: torch.Tensor) -> tuple[int, bool]:
    """The way of oneDNN's prepacked product the probe proves, as make_exact takes it:
    the largest tile, a lone row alone before padded to 2 ((0, False): none)."""
    tiles = [t for t in el.BFLOAT16_PACKED_TILES if w.numel() <= el.PROBE_LARGE or t <= 32]
    ways = [(t, lone) for lone in (True, False) for t in tiles]
    return next((way for way in ways if el.tiles_are_exact(w, packed, *way)), (0, False))


@pytest.mark.parametrize(("out", "inp"), [*SHAPES, (49152, 576)])
def test_bfloat16_prepacked_rows_equal_their_lone_result_in_any_call(out: int, inp: int) -> None:
    """oneDNN's product on a weight reordered for one row: a row's bits in any call up
    to the tile (and across tiles), the bits of ``weight @ x.T`` (the bf16 way before:
    the default model's bf16 bits are unchanged), near torch's product."""
    w = _weight(out, inp, torch.bfloat16)
    packed = el.onednn_pack(w)
    assert packed is not None  # this torch has oneDNN's prepacked product
    tile, lone = _bf16_way(w, packed)
    assert tile >= (128 if out < 49152 else 32)  # measured on the project's Xeon and EPYC
    assert lone or not XEON  # AMD's EPYC pads a lone row of 576 x 1,536
    n = 700 if out < 49152 else 70
    x = _rows(n, inp, torch.bfloat16)
    alone = _alone(w, x, packed=packed, tile=tile, lone=lone)  # type: ignore[arg-type]
    rng = random.Random(out + inp)
    for _ in range(12):
        lo = rng.randrange(0, n - 1)
        hi = rng.randrange(lo + 1, n + 1)
        got = exact_linear(x[lo:hi], w, None, packed=packed, tile=tile, lone=lone)
        assert torch.equal(got, alone[lo:hi]), (lo, hi)
    if lone:  # a lone row's own call: weight @ x.T's bits (the way before)
        assert torch.equal(alone, _alone(w, x))
    reference = F.linear(x.float(), w.float())
    assert (alone.float() - reference).abs().max() <= 2**-6 * reference.abs().max()


@pytest.mark.skipif(not XEON, reason="measured on Intel's Xeon (on AMD's EPYC it holds)")
def test_bfloat16_packing_for_more_rows_is_not_row_invariant() -> None:
    """Why the weight is reordered for one row: reordered for 64, a call of 33 rows or
    more gives a row other bits than alone (the reproduction for the choice)."""
    w = _weight(1536, 576, torch.bfloat16)
    if el.onednn_pack(w) is None:
        pytest.skip("no oneDNN prepacked product in this torch build")
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    assert not el.tiles_are_exact(w, packed, 512, lone=True)
    assert el.tiles_are_exact(w, packed, 32, lone=True)


def test_a_bfloat16_lone_row_is_padded_where_its_own_call_fails_the_probe() -> None:
    """AMD's EPYC: oneDNN's prepacked 576 x 1,536 (the MLP's down projection) gives a
    lone row other bits than any call of 2 rows or more (the reproduction), and
    make_exact then pads a lone row to 2; where a lone row's call holds (Intel's Xeon)
    it keeps it. Either way a row's bits are the same in every call."""
    w = _weight(576, 1536, torch.bfloat16)
    packed = el.onednn_pack(w)
    if packed is None:
        pytest.skip("no oneDNN prepacked product in this torch build")
    own_call = el.tiles_are_exact(w, packed, 512, lone=True)
    assert el.tiles_are_exact(w, packed, 512, lone=False)
    if not own_call:
        x = _rows(40, 1536, torch.bfloat16)
        mm = torch.ops.mkldnn._linear_pointwise
        lone_rows = torch.cat(
            [mm(r.contiguous(), packed, None, "none", [], "") for r in x.split(1)]
        )
        assert not torch.equal(lone_rows, mm(x, packed, None, "none", [], ""))
    model = nn.Sequential(nn.Linear(1536, 576, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(w)
        assert make_exact(model) == 0
        layer = model[0]
        assert layer.packed is not None
        assert layer.lone == own_call
        x = _rows(300, 1536, torch.bfloat16)
        got = model(x)
        for n in (0, 17, 299):
            assert torch.equal(model(x[n]), got[n])
            assert torch.equal(model(x[n : n + 1].view(1, 1, -1)), got[n].view(1, 1, -1))
        assert torch.equal(model(x[3:20]), got[3:20])
        # calls of 16, a lone row padded: 17 rows split 15 + 2 (no lone call in a split)
        tiled = exact_linear(x[:17], layer.weight, None, packed=packed, tile=16, lone=False)
        assert torch.equal(tiled, got[:17])
    assert (" padded to 2" in repr(layer)) != own_call


def test_make_exact_prepacks_bfloat16_and_frees_the_weight_unless_shared() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(576, 1536, bias=False), nn.Linear(1536, 576, bias=False), nn.Linear(576, 1536)
    ).to(torch.bfloat16)
    model[2].weight = model[0].weight  # tied: another module's bytes
    x = _rows(300, 576, torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        assert make_exact(model) == 0
        assert all(isinstance(m, ExactLinear) and m.packed is not None for m in model)
        assert "oneDNN" in repr(model[0])
        assert model[1].weight.untyped_storage().nbytes() == 2
        assert model[1].weight.shape == (576, 1536)
        assert model[0].weight.untyped_storage().nbytes() == 576 * 1536 * 2
        got = model(x)
        alone = torch.cat([model(row) for row in x.split(1)])
        # a lone row's short path (no reshapes), in each shape a decode step has
        for n in (0, 7, 299):
            assert torch.equal(model(x[n]), got[n])
            assert torch.equal(model(x[n : n + 1].view(1, 1, 576)), got[n].view(1, 1, -1))
    assert torch.equal(got, alone)
    assert torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.5)


def test_a_bfloat16_packing_that_fails_the_probe_falls_back_to_row_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = el.onednn_pack(_weight(192, 576, torch.bfloat16, seed=9))
    if other is None:
        pytest.skip("no oneDNN prepacked product in this torch build")
    monkeypatch.setattr(el, "onednn_pack", lambda weight: other)
    model = nn.Sequential(nn.Linear(576, 192, bias=False)).to(torch.bfloat16)
    assert make_exact(model) == 0
    assert model[0].packed is None
    assert model[0].tiled
    assert model[0].weight.untyped_storage().nbytes() == 576 * 192 * 2


def test_bfloat16_prepacked_rows_are_the_same_at_1_and_2_threads() -> None:
    w = _weight(1536, 576, torch.bfloat16)
    packed = el.onednn_pack(w)
    if packed is None:
        pytest.skip("no oneDNN prepacked product in this torch build")
    x = _rows(300, 576, torch.bfloat16)
    before = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = (
                _alone(w, x[:40], packed=packed, tile=512),  # type: ignore[arg-type]
                exact_linear(x, w, None, packed=packed, tile=512),
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1][0], got[2][0])
    assert torch.equal(got[1][1], got[2][1])
    assert torch.equal(got[1][0], got[1][1][:40])


def _rss() -> int:
    """The resident set once glibc has handed back its freed heap (the probes' scratch
    otherwise stays resident, or not, as its dynamic mmap threshold decides)."""
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_float32_linear_way_holds_no_bytes_beyond_the_weights() -> None:
    """What the planner charges a stage (its tensors' bytes) is what it holds: where
    make_exact takes F.linear's way, the resident set grows by no copy of the weights
    (MKL's packed copies there held ~1.7x the weights' bytes, measured RSS, uncharged)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(576, 1536, bias=False) for _ in range(8)])
    weights = 8 * 1536 * 576 * 4  # 27 MiB
    if not _quanta_hold(model[0].weight.detach()):
        pytest.skip("F.linear's classes differ on this CPU: a packed way is taken")
    make_exact(nn.Sequential(nn.Linear(576, 1536, bias=False)))  # the probe's scratch, once
    before = _rss()
    make_exact(model)
    grown = _rss() - before
    assert all(m.packed is None and m.quantum for m in model)
    assert grown < weights // 4, grown


def test_a_row_major_head_in_slices_gives_the_column_major_heads_bits() -> None:
    """load_stage keeps an fp32 head row-major where its linear layers are exact (it
    stores it column-major for torch's 1-row kernel, which the F.linear way never
    calls): in slices of 2,048 vocabulary rows a few rows' call streams it ~1.5x
    faster, and a row's bits are those of the column-major head's way, in any call."""
    w = _weight(49152, 576, torch.float32)
    if not _quanta_hold(w, el.LARGE_TILE):
        pytest.skip("F.linear's classes differ on this CPU: a packed way is taken")
    x = _rows(40, 576, torch.float32)
    kw = {"tile": el.LARGE_TILE, "least": el.LINEAR_LEAST, "quantum": el.LINEAR_QUANTUM}
    column_way = _alone(w.t().contiguous().t(), x, **kw)
    model = nn.Sequential(nn.Linear(576, 49152, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
        make_exact(model)
        assert model[0].weight.stride() == (576, 1)
        alone = torch.stack([model(row) for row in x])  # the lean path
        assert torch.equal(alone, column_way)
        for lo, hi in ((0, 40), (3, 20), (5, 6), (7, 9), (1, 33)):
            assert torch.equal(model(x[lo:hi]), alone[lo:hi]), (lo, hi)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [False, True], ids=["padded", "kernel"])
@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_float32_linear_calls_of_every_row_count_share_one_class(
    out: int, inp: int, kernel: bool
) -> None:
    """The probe at load checks some call sizes; here every call the F.linear way makes
    (1 to 300 rows, padded or tiled as exact_linear does; a few rows by the exact
    kernel where ``kernel``) gives each row its lone result, for the default model's
    shapes, at 1 and 2 threads."""
    w = _weight(out, inp, torch.float32)
    if not _quanta_hold(w):
        pytest.skip("F.linear's classes differ on this CPU: a packed way is taken")
    kw: dict[str, int] = {"least": el.LINEAR_LEAST, "quantum": el.LINEAR_QUANTUM}
    if kernel:
        kw["kernel"] = exact_kernel.kernel_block()
        if not kw["kernel"]:
            pytest.skip("the exact kernel does not hold here")
    x = _rows(300, inp, torch.float32)
    alone = _alone(w, x, **kw)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            differ = [
                m
                for m in range(1, 301)
                if not torch.equal(exact_linear(x[:m], w, None, **kw), alone[:m])
            ]  # type: ignore[arg-type]
            assert differ == [], threads
    finally:
        torch.set_num_threads(before)
