"""Per-session KV cache of one stage.

Each session that runs through a stage owns one :class:`SessionKV` there: the
keys and values of the stage's own layers (indexed locally, ``0..n-1``), in
buffers that grow by doubling. Sessions are independent objects, so a stage
can batch any mix of them — of any lengths, prefill chunks beside decode
steps — and a session can join, leave or be freed at any time.

``length`` counts the tokens committed by completed forwards: a forward that
fails half way leaves the session as it was. Tensors are written only inside
``torch.inference_mode()`` (a stage's forward), as in-place updates to
inference tensors are refused outside it.
"""

from __future__ import annotations

import torch

from hetmesh.errors import InvalidRequest

_MIN_CAPACITY = 64


class SessionKV:
    """The KV cache of one session on one stage."""

    def __init__(
        self,
        *,
        owner: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._owner = owner  # id of the StageModule that made it
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self._keys: list[torch.Tensor] = []  # per local layer: (kv_heads, capacity, head_dim)
        self._values: list[torch.Tensor] = []
        self._capacity = 0
        self._length = 0
        self._freed = False

    @property
    def length(self) -> int:
        """Tokens held: the position the next input token takes."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not only ``length``)."""
        per_slot = 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize
        return self._capacity * per_slot

    @property
    def used_bytes(self) -> int:
        """Bytes of keys and values for the ``length`` tokens held."""
        per_slot = 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize
        return self._length * per_slot

    @property
    def freed(self) -> bool:
        return self._freed

    def free(self) -> None:
        """Release the buffers; the session cannot be used afterwards."""
        self._keys.clear()
        self._values.clear()
        self._capacity = 0
        self._length = 0
        self._freed = True

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (e.g. to replay from a checkpoint)."""
        if not 0 <= length <= self._length:
            raise InvalidRequest(f"cannot truncate a KV cache of {self._length} tokens to {length}")
        self._length = length

    def __repr__(self) -> str:
        return (
            f"SessionKV(length={self._length}, layers={self.num_layers}, "
            f"nbytes={self.nbytes}, freed={self._freed})"
        )

    # -- used by StageModule during a forward -------------------------------------------------

    def _check_usable(self, owner: int) -> None:
        if self._freed:
            raise InvalidRequest("the session's KV cache was freed")
        if owner != self._owner:
            raise InvalidRequest("this KV cache belongs to another stage")

    def _reserve(self, extra: int) -> None:
        needed = self._length + extra
        if needed <= self._capacity or self.num_layers == 0:
            return
        capacity = max(_MIN_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, max(self.max_length, needed))
        shape = (self.kv_heads, capacity, self.head_dim)
        for store in (self._keys, self._values):
            for i in range(self.num_layers):
                grown = torch.empty(shape, dtype=self.dtype, device=self.device)
                if store and self._length:
                    grown[:, : self._length] = store[i][:, : self._length]
                if len(store) > i:
                    store[i] = grown
                else:
                    store.append(grown)
        self._capacity = capacity

    def _write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``(kv_heads, n, head_dim)`` after the held tokens.

        Returns views of all keys and values of ``layer`` including the new ones,
        ``(kv_heads, length + n, head_dim)``. ``length`` moves on only at commit.
        """
        start, end = self._length, self._length + key.shape[1]
        self._keys[layer][:, start:end] = key
        self._values[layer][:, start:end] = value
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def _commit(self, n: int) -> None:
        self._length += n


__all__ = ["SessionKV"]
