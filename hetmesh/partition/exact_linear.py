"""Float linear layers whose result for a row does not depend on the other rows.

A CPU's BLAS picks its kernel by the call's shape, and each kernel sums a
row's products in its own order, so in ``float32`` and ``bfloat16`` one token's
projections differed in their last bits between a prompt prefilled whole and
in chunks, a session decoding alone and beside others, a history replayed and
the same tokens decoded one at a time (issue 44; the int4 and int8 kernels do
not have this: their rows are independent at every size). Measured on the
project's Xeon (torch 2.13, MKL 2024.2, oneDNN 3.12; docs/weights.md,
"Exactness"), for every matrix of the default model:

* ``float32`` ``F.linear`` (MKL) has three classes of call: 1 row (a
  matrix-vector kernel), 2 to 15 rows (one small-matrix kernel), 16 rows or
  more (the blocked kernel); within a class a row's result is the same, across
  them it differs. :func:`exact_linear` keeps every call in the middle class:
  rows in tiles of 2 to 15, a lone row padded with a zero row. A decode step
  costs what it did (2 rows take the time of 1 there); a long prefill pays
  more per row than the blocked kernel.
* ``bfloat16`` ``F.linear`` (oneDNN) gives a row the same result for up to 32
  rows and not beyond; ``weight @ x.T`` gives the single row's result for up
  to 128 rows, and is as fast there: rows go in tiles of 128 that way.

Other shapes draw the classes elsewhere (MKL treats a small matrix, K = 64,
its own way; oneDNN's ``weight @ x.T`` differs past 3 rows at K = 8,192), and
so may another CPU or BLAS. So :func:`make_exact` probes each distinct weight
shape once, at load: random rows computed in calls of 1 to 130 rows must equal
the same rows computed one by one, else that layer computes one row per call
(invariant by construction: every call has the same shape; slower for a
prefill, unchanged for a decode step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FLOAT32_TILE = 15  # MKL's small-matrix kernel: 2 to 15 rows
BFLOAT16_TILE = 128  # oneDNN's weight @ x.T: a row's sums as alone, up to 128 rows


def _float32_tiles(rows: int) -> list[int]:
    """Tile sizes for ``rows`` rows, each 2 to 15 (a lone row is padded to 2)."""
    if rows <= FLOAT32_TILE:
        return [rows]
    sizes = [FLOAT32_TILE] * (rows // FLOAT32_TILE)
    rest = rows % FLOAT32_TILE
    if rest == 1:  # 15 + 1 -> 14 + 2
        sizes[-1] -= 1
        rest = 2
    if rest:
        sizes.append(rest)
    return sizes


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, tiled: bool = True
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row is computed as it would be alone:
    in tiles (see the module's docstring), or one row per call where not ``tiled``."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    count = rows.shape[0]
    if not tiled and rows.dtype in (torch.float32, torch.bfloat16):
        parts = [F.linear(row, weight) for row in torch.split(rows, 1)]
        out = torch.cat(parts) if count > 1 else parts[0]
    elif rows.dtype == torch.float32:
        if count == 1:
            out = F.linear(F.pad(rows, (0, 0, 0, 1)), weight)[:1]
        else:
            tiles = _float32_tiles(count)
            if len(tiles) == 1:
                out = F.linear(rows, weight)
            else:
                out = torch.cat([F.linear(t, weight) for t in torch.split(rows, tiles)])
    elif rows.dtype == torch.bfloat16:
        parts = [torch.mm(weight, t.t()).t() for t in torch.split(rows, BFLOAT16_TILE)]
        out = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


# calls the probe makes: every fp32 tile size, the tile splits around 15 and 30,
# bf16's classes up to and past one tile of 128
PROBE_ROWS = (*range(1, 18), 29, 30, 31, 33, 46, 64, 127, 128, 129, 130)
PROBE_LARGE = 1 << 24  # weights of more elements: calls of up to 33 rows only


class ExactLinear(nn.Linear):
    """An ``nn.Linear`` computed by :func:`exact_linear` (same parameters, same state dict)."""

    tiled: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, self.weight, self.bias, tiled=self.tiled)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", row tiles" if self.tiled else ", one row per call")


def tiles_are_exact(weight: torch.Tensor) -> bool:
    """Whether :func:`exact_linear`'s tiles give ``weight``'s rows their lone results
    (random rows, the calls of :data:`PROBE_ROWS`)."""
    sizes = [m for m in PROBE_ROWS if weight.numel() <= PROBE_LARGE or m <= 33]
    g = torch.Generator().manual_seed(44)
    x = torch.randn(max(sizes), weight.shape[1], generator=g).to(weight.dtype)
    with torch.no_grad():
        alone = torch.cat([exact_linear(row, weight, None) for row in torch.split(x, 1)])
        return all(torch.equal(exact_linear(x[:m], weight, None), alone[:m]) for m in sizes)


def make_exact(module: nn.Module) -> int:
    """Turn every plain float ``nn.Linear`` under ``module`` into an :class:`ExactLinear`
    in place (its class only: the tensors stay where they are), tiled where
    :func:`tiles_are_exact` holds for its shape, one row per call elsewhere; returns
    how many layers compute one row per call."""
    verdicts: dict[tuple[object, ...], bool] = {}
    untiled = 0
    for sub in module.modules():
        if type(sub) is not nn.Linear or sub.weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        w = sub.weight
        key = (w.dtype, w.device, tuple(w.shape), w.stride())
        if key not in verdicts:
            verdicts[key] = w.device.type != "cpu" or tiles_are_exact(w)
        sub.__class__ = ExactLinear
        if not verdicts[key]:
            sub.tiled = False  # type: ignore[assignment]
            untiled += 1
    return untiled


__all__ = [
    "BFLOAT16_TILE",
    "FLOAT32_TILE",
    "PROBE_ROWS",
    "ExactLinear",
    "exact_linear",
    "make_exact",
    "tiles_are_exact",
]
