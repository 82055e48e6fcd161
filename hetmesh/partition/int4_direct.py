"""torch's packed int4 layout built straight from Q4_1 bytes, by byte operations.

:meth:`~hetmesh.partition.quant.Int4Linear.pack` unpacks a Q4_1 matrix to one
byte a weight, widens it to int32 (four bytes a weight) and hands it to torch's
packer: three full-size temporaries and most of a stage's load time. Both
layouts put two 4-bit weights in a byte, so the packed bytes can be computed
from the file's bytes directly:

- a Q4_1 row's block of 32 inputs is 16 bytes; byte ``t`` holds input ``t`` in its
  low nibble and input ``t + 16`` in its high nibble;
- torch's CPU packing (:func:`~hetmesh.partition.quant.int4_layout_name`) groups
  rows in blocks of ``B`` (32 or 64) and, per block and per input, stores ``B / 2``
  bytes whose low nibbles are one half of the block's rows and high nibbles the
  other half ("halves": rows ``j`` and ``j + B/2``; "pairs": rows ``2j`` and
  ``2j + 1``).

So for the two rows ``L`` and ``H`` that share a packed byte, inputs ``t < 16`` of a
block are ``(L & 0x0F) | (H << 4)`` and inputs ``t + 16`` are ``(L >> 4) | (H & 0xF0)``
of the file's bytes, once a transpose has put inputs before rows. The result equals
torch's packer's, byte for byte (tests/unit/partition/test_int4_direct.py), and
the scales and zero points are :meth:`Int4Linear.pack`'s.

Pure torch, no I/O.
"""

from __future__ import annotations

import torch

from hetmesh.partition.quant import int4_layout_name

GROUP = 32  # inputs per Q4_1 block (and per int4 scale group)
_LAYOUTS = {"halves of 64": (True, 64), "halves of 32": (True, 32)}
_LAYOUTS |= {"pairs in 32": (False, 32), "pairs in 64": (False, 64)}
PAD_ROWS = 64  # int4 matrices are padded to whole blocks of 64 rows (quant._INT4_BLOCK_N)
# A checkpoint's Q4_1 nibbles stored already in torch's packed layout (written so by
# ``hetmesh model synth``): ``name.q4_1.<tag>`` instead of ``name.q4_1.qs``, the tag
# naming the layout (this format's version: a new layout is a new tag). Same bytes,
# another order; ``d`` and ``m`` as before.
PACKED_TAGS = {"halves of 64": "int4h64", "halves of 32": "int4h32"}
PACKED_TAGS |= {"pairs in 32": "int4p32", "pairs in 64": "int4p64"}


def pack_q4_1_into(qs: torch.Tensor, out: torch.Tensor) -> None:
    """Write the packed int4 rows of Q4_1 bytes ``qs`` (uint8 ``(n, k/2)``, ``n`` a
    multiple of 64) into ``out`` (uint8 ``(n, k/2)``, contiguous; e.g. a slice of rows
    of the whole matrix's packed tensor)."""
    n, half = qs.shape
    if n % PAD_ROWS or half % (GROUP // 2):
        raise ValueError(f"Q4_1 rows of shape {tuple(qs.shape)}: not whole blocks")
    if out.shape != qs.shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError("out must be a contiguous uint8 tensor shaped like qs")
    halves, block = _LAYOUTS[int4_layout_name()]
    blocks, width, groups = n // block, block // 2, half // (GROUP // 2)
    # the file's bytes with inputs before rows first (one byte transpose, of the
    # input: transposing the combined bytes after costs about twice as much, measured),
    # as (blocks, 2: the rows of low nibbles then of high ones, half, width)
    if halves:  # rows j (low nibbles) and j + block / 2 (high) of each block
        turned = qs.view(blocks, 2, width, half).transpose(2, 3).contiguous()
    else:  # rows 2j (low) and 2j + 1 (high)
        turned = qs.view(blocks, width, 2, half).permute(0, 2, 3, 1).contiguous()
    low = turned[:, 0].view(blocks, groups, GROUP // 2, width)
    high = turned[:, 1].view(blocks, groups, GROUP // 2, width)
    # out as (blocks, groups, 2, 16, width): each group's first 16 inputs, then its last 16
    both = out.view(blocks, groups, 2, GROUP // 2, width)
    first, second = both[:, :, 0], both[:, :, 1]
    torch.bitwise_left_shift(high, 4, out=first)
    first |= low & 0x0F
    torch.bitwise_right_shift(low, 4, out=second)
    second |= high & 0xF0


def scales_zeros(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's ``(groups, n, 2)`` bf16 scales and zero points of Q4_1's
    ``w = d * q + m`` (``d``, ``m``: ``(n, groups)``); the kernel computes
    ``(q - 8) * scale + zero``, so the zero point is ``m + 8 d`` (rounded to bf16, as
    :meth:`~hetmesh.partition.quant.Int4Linear.pack` rounds it)."""
    n, groups = d.shape
    pairs = torch.empty((n, groups, 2), dtype=torch.bfloat16)
    d32 = d.float()
    pairs[..., 0].copy_(d32)
    torch.add(m.float(), d32, alpha=8.0, out=d32)  # exact: 8 d is, then one rounding
    pairs[..., 1].copy_(d32)
    # rows before groups: each (scale, zero) pair moves as one 4-byte word
    words = pairs.view(torch.int32).reshape(n, groups).t().contiguous()
    return words.view(torch.bfloat16).reshape(groups, n, 2)


def packed_suffix(layout: str | None = None) -> str:
    """The tensor suffix of Q4_1 nibbles packed in ``layout`` (default: this process's)."""
    return f".q4_1.{PACKED_TAGS[layout or int4_layout_name()]}"


def q4_1_from_packed(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """Packed rows (``layout``; ``n`` a multiple of 64) -> Q4_1's bytes ``(n, k/2)``:
    :func:`pack_q4_1_into` undone, by the same byte operations and one transpose."""
    n, half = packed.shape
    if n % PAD_ROWS or half % (GROUP // 2):
        raise ValueError(f"packed rows of shape {tuple(packed.shape)}: not whole blocks")
    halves, block = _LAYOUTS[layout]
    blocks, width, groups = n // block, block // 2, half // (GROUP // 2)
    both = packed.contiguous().view(blocks, groups, 2, GROUP // 2, width)
    first, second = both[:, :, 0], both[:, :, 1]
    # (blocks, 2: the rows of low nibbles then of high ones, half, width), as packing had it
    turned = torch.empty((blocks, 2, half, width), dtype=torch.uint8)
    low = turned[:, 0].view(blocks, groups, GROUP // 2, width)
    high = turned[:, 1].view(blocks, groups, GROUP // 2, width)
    torch.bitwise_left_shift(second, 4, out=low)  # the low rows' inputs t + 16
    low |= first & 0x0F  # ... and t
    torch.bitwise_right_shift(first, 4, out=high)  # the high rows' inputs t
    high |= second & 0xF0  # ... and t + 16
    # halves: (blocks, 2, width, half), rows j then j + block / 2; pairs: (blocks, width,
    # 2, half), rows 2j and 2j + 1
    qs = turned.transpose(2, 3) if halves else turned.permute(0, 3, 1, 2)
    return qs.contiguous().view(n, half)


__all__ = [
    "GROUP",
    "PACKED_TAGS",
    "PAD_ROWS",
    "pack_q4_1_into",
    "packed_suffix",
    "q4_1_from_packed",
    "scales_zeros",
]
