"""Reading one tensor of a model folder, whatever compact form it is stored in.

A model folder's safetensors hold each tensor ``name`` in one of three forms:

- ``name``: a float tensor (fp32, bf16 or fp16), as in any Hugging Face folder;
- ``name.q4_1.qs`` (uint8 ``(n, k/2)``), ``name.q4_1.d`` and ``name.q4_1.m``
  (fp16 ``(n, k/32)``): GGUF Q4_1 blocks, ``w = d * q + m`` per 32 inputs; a
  block's 16 bytes hold inputs 0..15 in their low nibbles and 16..31 in their
  high nibbles (GGUF's own order, copied without repacking). Q4_0 is stored
  the same way with ``m = -8 d``;
- ``name.q8_0.qs`` (int8 ``(n, k)``) and ``name.q8_0.d`` (fp16 ``(n, k/32)``):
  GGUF Q8_0 blocks, ``w = d * q``.

:class:`CheckpointReader` hands out rows of any of them as fp32 (dequantising
only the rows asked for) and Q4_1 blocks as they are, so a stage loads into
any format one tensor (or one slice of rows) at a time.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import torch

from hetmesh.errors import CorruptModel
from hetmesh.partition.store import brief_error, weight_files

Kind = Literal["float", "q4_1", "q8_0"]
BLOCK = 32
ROW_CHUNK = 4096  # rows dequantised at once when reading a large table


class CheckpointReader:
    """Tensors of one model folder; use as a context manager (files stay open inside)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = weight_files(folder)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def kind(self, name: str) -> Kind | None:
        if name in self.files:
            return "float"
        if f"{name}.q4_1.qs" in self.files:
            return "q4_1"
        if f"{name}.q8_0.qs" in self.files:
            return "q8_0"
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical (dequantised) shape of ``name``."""
        kind = self._require(name)
        if kind == "float":
            return tuple(self._slice(name).get_shape())
        rows, width = self._slice(f"{name}.{kind}.qs").get_shape()
        return (rows, width * 2) if kind == "q4_1" else (rows, width)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name`` (the whole of a 1-D tensor) as fp32."""
        kind = self._require(name)
        try:
            if kind == "float":
                part = self._slice(name)
                if len(part.get_shape()) == 1:
                    return part[:].float()  # type: ignore[no-any-return]
                return part[start:stop].float()  # type: ignore[no-any-return]
            if kind == "q4_1":
                q, d, m = self._q4_rows(name, start, stop)
                n, k = q.shape
                w = q.float().reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]
                return w.reshape(n, k)
            qs: torch.Tensor = self._slice(f"{name}.q8_0.qs")[start:stop]
            d = self._slice(f"{name}.q8_0.d")[start:stop].float()
            n, k = qs.shape
            w8: torch.Tensor = qs.float().reshape(n, k // BLOCK, BLOCK) * d[..., None]
            return w8.reshape(n, k)
        except CorruptModel:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def tensor(self, name: str) -> torch.Tensor:
        """All of ``name`` as fp32."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0])

    def q4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_1 tensor's own blocks: ``(q uint8 (n, k) in 0..15, d fp32, m fp32)``."""
        rows = self.shape(name)[0]
        try:
            return self._q4_rows(name, 0, rows)
        except Exception as exc:
            raise CorruptModel(f"{self.folder}: cannot read {name} ({brief_error(exc)})") from exc

    def _q4_rows(
        self, name: str, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qs = self._slice(f"{name}.q4_1.qs")[start:stop]  # (n, k/2) uint8
        d = self._slice(f"{name}.q4_1.d")[start:stop].float()
        m = self._slice(f"{name}.q4_1.m")[start:stop].float()
        n, half = qs.shape
        blocks = qs.reshape(n, half // (BLOCK // 2), BLOCK // 2)
        q = torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)
        return q, d, m

    def _require(self, name: str) -> Kind:
        kind = self.kind(name)
        if kind is None:
            raise CorruptModel(f"{self.folder}: tensor {name} missing from the checkpoint")
        return kind

    def _slice(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise CorruptModel(f"{self.folder}: tensor {name} missing from the checkpoint")
        file = self.files[name]
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as exc:
                raise CorruptModel(f"{file}: unreadable safetensors ({brief_error(exc)})") from exc
            self._handles[file] = handle
        return handle.get_slice(name)


__all__ = ["BLOCK", "ROW_CHUNK", "CheckpointReader", "Kind"]
