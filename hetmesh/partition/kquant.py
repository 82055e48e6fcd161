"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) decoded with torch, a slice of rows at a time.

A compact folder keeps a K-quant tensor as its GGUF blocks, unchanged:
``name.<kind>.blocks``, uint8 ``(rows, width / 256 * block bytes)`` (each row
is whole super-blocks of 256 inputs). Layouts, per super-block:

- **Q4_K** (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit
  scales ``sc`` and eight 6-bit mins ``m``, then 128 bytes of 4-bit ``q``.
  Sub-block ``j`` (32 inputs) is ``w = (d * sc_j) * q - (dmin * m_j)``.
- **Q5_K** (176 bytes): as Q4_K, with a fifth bit of each ``q`` in 32 bytes
  placed before the 4-bit part (``q`` in 0..31).
- **Q6_K** (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits,
  sixteen int8 scales (one per 16 inputs) and fp16 ``d``:
  ``w = (d * sc_j) * (q - 32)``.

Each function computes the same fp32 operations, in the same order, as the
``gguf`` package's numpy reference, so its values are bit-identical to
``gguf.quants.dequantize`` (tests check this on random blocks).

Q4_K is 4-bit groups of 32 with a scale and a minimum, Q4_1's form:
:func:`q4_k_groups` gives them (``d * sc_j`` and ``dmin * m_j`` are exact in
fp32: an 11-bit fp16 mantissa times a 6-bit integer), so an int4 stage holds
a Q4_K tensor's own 4-bit levels.
"""

from __future__ import annotations

import torch
from torch import nn

SUPER = 256  # inputs per super-block
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
GGUF_NAMES = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def logical_width(kind: str, stored_width: int) -> int:
    """Inputs per row of a ``kind`` tensor whose rows hold ``stored_width`` bytes."""
    return stored_width // BLOCK_BYTES[kind] * SUPER


def _split(blocks: torch.Tensor, kind: str) -> tuple[int, int, torch.Tensor]:
    """``(rows, super-blocks per row, blocks as (rows * supers, bytes))``."""
    rows, width = blocks.shape
    size = BLOCK_BYTES[kind]
    if width % size:
        raise ValueError(f"{kind} rows of {width} bytes are not whole blocks of {size}")
    supers = width // size
    return rows, supers, blocks.reshape(rows * supers, size)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (little-endian fp16) -> fp32 ``(n, 1)``."""
    return raw.contiguous().view(torch.float16).float()


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, fp32 ``(n, 8)``."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> eight sub-blocks of 32: chunk c's low nibbles, then its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    both = torch.cat([chunks & 0x0F, chunks >> 4], dim=2)  # (n, 4, 2, 32)
    return both.reshape(-1, 8, 32)


def q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows -> ``(q uint8 (n, k) in 0..15, scale fp32 (n, k/32), minimum fp32 (n, k/32))``
    with ``w = scale * q + minimum`` (the minimum is ``-dmin * m_j``), all exact."""
    rows, supers, b = _split(blocks, "q4_k")
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _scales_mins(b[:, 4:16])
    q = _low_nibbles(b[:, 16:144])
    scale = (d * sc).reshape(rows, supers * 8)
    minimum = -(dmin * mn).reshape(rows, supers * 8)
    return q.reshape(rows, supers * SUPER), scale, minimum


def dequantize(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """``kind`` rows -> fp32 ``(n, k)``, bit-identical to ``gguf.quants.dequantize``."""
    rows, supers, b = _split(blocks, kind)
    if kind in ("q4_k", "q5_k"):
        d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
        sc, mn = _scales_mins(b[:, 4:16])
        scale = (d * sc)[..., None]  # (n, 8, 1)
        offset = (dmin * mn)[..., None]
        if kind == "q4_k":
            q = _low_nibbles(b[:, 16:144]).float()
        else:
            bits = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
            high = b[:, 16:48].reshape(-1, 1, 32) >> bits
            q = (_low_nibbles(b[:, 48:176]) | ((high & 1) << 4)).float()
        w = scale * q - offset
    elif kind == "q6_k":
        ql = b[:, 0:128].reshape(-1, 2, 1, 64)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
        high = ((qh >> shifts) & 3).reshape(-1, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _fp16(b[:, 208:210])
        w = (d * sc)[..., None] * q
    else:
        raise ValueError(f"not a K-quant kind: {kind}")
    return w.reshape(rows, supers * SUPER)


class KQuantEmbedding(nn.Module):
    """A token table kept as its K-quant blocks; a lookup decodes only the rows it returns.

    A compact stage's table is otherwise int8 per row (8 bits a weight against a
    Q4_K file's 4.5). Lookups touch a few rows per step, so decoding them each
    time costs nothing measurable, and the values are the file's own exactly.
    """

    blocks: torch.Tensor

    def __init__(self, kind: str, num_embeddings: int, dim: int, *, device: torch.device | str):
        super().__init__()
        if dim % SUPER:
            raise ValueError(f"{kind} rows must be whole super-blocks of {SUPER}")
        self.kind, self.num_embeddings, self.dim = kind, num_embeddings, dim
        width = dim // SUPER * BLOCK_BYTES[kind]
        self.register_buffer(
            "blocks", torch.empty(num_embeddings, width, dtype=torch.uint8, device=device)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)]
        return dequantize(self.kind, rows).reshape(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, {self.kind} blocks"


__all__ = [
    "BLOCK_BYTES",
    "GGUF_NAMES",
    "SUPER",
    "KQuantEmbedding",
    "dequantize",
    "logical_width",
    "q4_k_groups",
]
