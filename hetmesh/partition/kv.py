"""Paged KV cache of one stage: a pool of fixed-size blocks and per-session block tables.

A :class:`KVPool` holds the keys and values of a stage's layers for every
session at once, as two tensors ``(layers, kv_heads, blocks × 16, head_dim)``
(head-major: gathering along the slot axis measured ~2× cheaper than a
block-major layout, see ``../shared/KV.md``). Which blocks are free is kept
by a pure :class:`~hetmesh.partition.blocks.BlockAllocator`.

Each session owns one :class:`SessionKV`: its block table (the pool's blocks
holding its tokens, in order) and ``length``. Blocks are taken as tokens
arrive (:meth:`SessionKV.reserve`) and all return to the pool on
:meth:`SessionKV.free`. Attention reads a session's keys and values as a
*view* of the pool when its blocks form one run (the allocator keeps them so
whenever it can), else it gathers them by slot index (``bench/kv.py``
measures both). Sessions are independent objects, so a stage can batch any
mix of them — of any lengths, prefill chunks beside decode steps.

Full blocks can be shared: a pool keeps a
:class:`~hetmesh.partition.prefix.PrefixCache` of blocks named by the token
prefix they complete. A new session attaches the cached blocks its prompt
starts with (:meth:`SessionKV.attach`) and computes only the rest; its own
blocks are named once full (:meth:`SessionKV.publish`). A shared block is
never written (a session appends only after its last full block), and when
no session holds it any more it stays cached, counted as free, until the
pool needs it for new tokens (least recently used first). A block is found
only by sessions of the same ``scope`` (their gateway), and KV loaded from
another peer is never named (:mod:`hetmesh.partition.prefix`).

A stage server's pool is fixed in size (its KV budget); the trio thread
allocates, frees and names blocks, and a link's reader thread computing a
session's decode step (:mod:`hetmesh.node.stage_lane`) may take that
session its next block (:meth:`SessionKV.extend`: a free block only, never a
cached one, and never more than the pool holds), so the block table of the
allocator is kept under the pool's lock. A session made without a pool
(``StageModule.new_kv()``) gets a private pool that grows as needed.

``length`` counts the tokens committed by completed forwards: a forward that
fails half way leaves the session as it was. Tensors are written only inside
``torch.inference_mode()`` (a stage's forward), as in-place updates to
inference tensors are refused outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from hetmesh.errors import InvalidRequest, Rejected
from hetmesh.partition.blocks import BLOCK_TOKENS, BlockAllocator, blocks_for, is_run
from hetmesh.partition.prefix import PrefixCache, scoped

_MIN_PRIVATE_BLOCKS = 4


class KVPool:
    """Keys and values of ``num_blocks`` blocks of a stage's layers."""

    def __init__(
        self,
        *,
        num_blocks: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        growable: bool = False,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.growable = growable
        self.block_tokens = block_tokens
        self.allocator = BlockAllocator(num_blocks, block_tokens)
        # the allocator's: trio's takes and releases, and a reader thread's take_free
        self._lock = threading.Lock()
        self.prefix = PrefixCache()
        shape = (num_layers, kv_heads, num_blocks * block_tokens, head_dim)
        # torch.empty: untouched pages of a large pool cost no memory until used
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a session can get: free ones plus cached ones nobody holds."""
        return self.allocator.free_blocks + self.prefix.idle_blocks

    @property
    def cached_blocks(self) -> int:
        return self.prefix.cached_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of keys and values one block holds across the stage's layers."""
        per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize
        return self.block_tokens * per_token

    def take(self, count: int, after: int | None) -> list[int] | None:
        """``count`` blocks (a growable pool grows for them), or None when full.

        On the thread that owns the prefix cache (trio's, in a stage server)."""
        with self._lock:
            short = count - self.allocator.free_blocks
            if short > 0 and self.prefix.idle_blocks:  # reuse the least recently used cached
                self.allocator.free(self.prefix.evict(short))
            blocks = self.allocator.allocate(count, after=after)
            if blocks is None and self.growable:
                self._grow(max(count, self.num_blocks, _MIN_PRIVATE_BLOCKS))
                blocks = self.allocator.allocate(count, after=after)
            return blocks

    def take_free(self, count: int, after: int | None) -> list[int] | None:
        """``count`` blocks free now, or None: from any thread, as it touches neither the
        prefix cache (no cached block is reused) nor the pool's tensors (it never grows)."""
        with self._lock:
            return self.allocator.allocate(count, after=after)

    def release(self, blocks: list[int]) -> None:
        """A session lets ``blocks`` go: cached ones stay (idle), the others are freed."""
        with self._lock:
            self.allocator.free([b for b in blocks if not self.prefix.release(b)])

    def _grow(self, extra: int) -> None:
        slots = extra * self.block_tokens
        pad = (self.num_layers, self.kv_heads, slots, self.head_dim)
        with torch.inference_mode():  # the pool's tensors are inference tensors
            self.keys = torch.cat([self.keys, self.keys.new_empty(pad)], dim=2)
            self.values = torch.cat([self.values, self.values.new_empty(pad)], dim=2)
        self.allocator.grow(extra)


class SessionKV:
    """The KV cache of one session on one stage: a block table into a :class:`KVPool`."""

    def __init__(self, *, owner: int, pool: KVPool, max_length: int) -> None:
        self._owner = owner  # id of the StageModule that made it
        self.pool = pool
        self.num_layers = pool.num_layers
        self.max_length = max_length
        self.blocks: list[int] = []  # the block table
        self._slots: torch.Tensor | None = None  # slot index of every held token position
        self._base: int | None = None  # first slot when the blocks form one run
        self._length = 0
        self._published = 0  # leading blocks already named in the pool's prefix cache
        self._freed = False
        # whose sessions may share its blocks (its gateway's peer id: prefix.scoped)
        self.scope = ""
        self._foreign = False  # holds KV another peer computed (a migration's): never named

    @property
    def length(self) -> int:
        """Tokens held: the position the next input token takes."""
        return self._length

    @property
    def capacity(self) -> int:
        """Token slots held (whole blocks)."""
        return len(self.blocks) * self.pool.block_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held (capacity, not only ``length``)."""
        return len(self.blocks) * self.pool.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of keys and values for the ``length`` tokens held."""
        return self._length * self.pool.block_bytes // self.pool.block_tokens

    @property
    def contiguous(self) -> bool:
        """Whether the keys and values are read as a view (no gather)."""
        return self._base is not None

    @property
    def freed(self) -> bool:
        return self._freed

    def reserve(self, tokens: int) -> bool:
        """Hold blocks for ``tokens`` tokens in all; False (nothing taken) if the pool is full."""
        return self._hold(tokens, self.pool.take)

    def extend(self, tokens: int) -> bool:
        """:meth:`reserve` from a thread other than the pool's owner, for a session no
        other thread touches meanwhile: only blocks free now (False, nothing taken, if
        there are too few: the owner's :meth:`reserve` evicts cached blocks, grows a
        private pool or the stage preempts a session for them)."""
        return self._hold(tokens, self.pool.take_free)

    def _hold(self, tokens: int, take: Callable[[int, int | None], list[int] | None]) -> bool:
        if self._freed:
            raise InvalidRequest("the session's KV cache was freed")
        missing = blocks_for(tokens, self.pool.block_tokens) - len(self.blocks)
        if missing <= 0 or self.num_layers == 0:
            return True
        got = take(missing, self.blocks[-1] if self.blocks else None)
        if got is None:
            return False
        self.blocks.extend(got)
        self._index()
        return True

    def attach(self, hashes: Sequence[int], max_tokens: int) -> int:
        """Start from the pool's cached blocks for the leading ``hashes``, at most ``max_tokens``.

        Only on a new, empty session. Returns the tokens now held (whole
        blocks): the caller feeds the prompt from there. A stage without
        layers holds no KV and can start wherever it is told.
        """
        if self._freed or self.blocks or self._length:
            raise InvalidRequest("a prefix attaches only to a new session")
        size = self.pool.block_tokens
        usable = list(hashes[: max(0, max_tokens) // size])
        if self.num_layers == 0:
            self._length = len(usable) * size
            return self._length
        self.blocks = self.pool.prefix.lookup(scoped(usable, self.scope))
        self._length = len(self.blocks) * size
        self._published = len(self.blocks)
        self._index()
        return self._length

    def publish(self, hashes: Sequence[int]) -> None:
        """Name the session's full blocks by ``hashes`` (those of the tokens it holds).

        ``hashes[i]`` must be the chained hash of the tokens in positions
        ``[0, 16 (i + 1))`` as fed to this session; only blocks whose tokens
        are all committed are named, by their :func:`~hetmesh.partition.prefix.scoped`
        names for the session's ``scope``. A session that loaded KV another peer
        computed (:meth:`load`) names nothing: what it holds is that peer's word.
        """
        if self._freed or self.num_layers == 0 or self._foreign:
            return
        full = min(len(hashes), self._length // self.pool.block_tokens)
        if full <= self._published:
            return
        names = scoped(hashes[self._published : full], self.scope)
        for i, name in enumerate(names, start=self._published):
            self.pool.prefix.insert(self.blocks[i], name)
        self._published = full

    def rewind(self, position: int) -> None:
        """Forget the tokens from ``position`` (a block boundary) on, letting their blocks go.

        A gateway that agreed with the pipeline on fewer cached tokens than
        this stage attached starts its prompt there.
        """
        size = self.pool.block_tokens
        if not 0 <= position <= self._length:
            raise InvalidRequest(f"cannot rewind a KV cache of {self._length} tokens to {position}")
        if self.num_layers == 0:
            self._length = position
            return
        if position % size:
            raise InvalidRequest(f"a KV cache rewinds to a block boundary, not {position}")
        keep = position // size
        self.pool.release(self.blocks[keep:])
        self.blocks = self.blocks[:keep]
        self._length = position
        self._published = min(self._published, keep)
        self._index()

    def free(self) -> None:
        """Return every block to the pool; the session cannot be used afterwards."""
        if not self._freed:
            self.pool.release(self.blocks)
        self.blocks = []
        self._slots = self._base = None
        self._length = 0
        self._freed = True

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (e.g. to replay from a checkpoint)."""
        if not 0 <= length <= self._length:
            raise InvalidRequest(f"cannot truncate a KV cache of {self._length} tokens to {length}")
        if any(self.pool.prefix.holds(b) for b in self.blocks[length // self.pool.block_tokens :]):
            # its slots would be written again: shared blocks must go (rewind), not be overwritten
            raise InvalidRequest("cannot truncate into a block of the prefix cache; rewind instead")
        self._length = length

    def export(
        self, layers: slice = slice(None), start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the tokens held from position ``start``, in the pool's
        dtype, of ``layers`` (all: a migration's; the first few: a split prefill's).

        Two contiguous tensors ``(layers, kv_heads, length - start, head_dim)``
        (only the filled part of the blocks). A copy, so the blocks can be freed
        while the tensors are on their way.
        """
        if self._freed:
            raise InvalidRequest("the session's KV cache was freed")
        if not 0 <= start <= self._length:
            raise InvalidRequest(f"no position {start} in a KV cache of {self._length} tokens")
        keys, values = self.pool.keys[layers], self.pool.values[layers]
        n = self._length - start
        if self.num_layers == 0 or n == 0:
            empty = (keys.shape[0], self.pool.kv_heads, n, self.pool.head_dim)
            return (
                torch.empty(empty, dtype=self.pool.dtype),
                torch.empty(empty, dtype=self.pool.dtype),
            )
        if self._base is not None:  # one run: a slice of the pool, copied once
            lo = self._base + start
            return (
                keys[:, :, lo : lo + n].contiguous().cpu(),
                values[:, :, lo : lo + n].contiguous().cpu(),
            )
        assert self._slots is not None  # set with the blocks
        held = self._slots[start : start + n]
        return keys.index_select(2, held).cpu(), values.index_select(2, held).cpu()

    def fill(self, first_layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write another peer's keys and values ``(layers, kv_heads, n, head_dim)`` of
        layers from ``first_layer``, positions ``[start, start + n)``, into the session's
        blocks (the layers a split prefill's helper computed; see
        :mod:`hetmesh.node.split`). The positions need not be committed yet, but their
        blocks must be held and none of them shared with the prefix cache.
        """
        if self._freed:
            raise InvalidRequest("the session's KV cache was freed")
        layers, n = int(keys.shape[0]), int(keys.shape[2])
        if first_layer < 0 or first_layer + layers > self.num_layers:
            raise InvalidRequest(
                f"layers [{first_layer}, {first_layer + layers}) are not all held here"
            )
        size = self.pool.block_tokens
        if start < 0 or start + n > self.capacity:
            raise InvalidRequest(
                f"positions [{start}, {start + n}) are not within the {self.capacity} held"
            )
        touched = self.blocks[start // size : -(-(start + n) // size)]
        if any(self.pool.prefix.holds(b) for b in touched):
            raise InvalidRequest("cannot fill a block of the prefix cache")
        if layers == 0 or n == 0:
            return
        span = slice(first_layer, first_layer + layers)
        with torch.inference_mode():  # the pool's tensors may be inference tensors
            if self._base is not None:
                lo = self._base + start
                self.pool.keys[span, :, lo : lo + n] = keys.to(self.pool.device)
                self.pool.values[span, :, lo : lo + n] = values.to(self.pool.device)
                return
            assert self._slots is not None  # set with the blocks
            slots = self._slots[start : start + n]
            self.pool.keys[span].index_copy_(2, slots, keys.to(self.pool.device))
            self.pool.values[span].index_copy_(2, slots, values.to(self.pool.device))

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill a new, empty session with another stage's ``export()`` of the same layers.

        The caller (the stage server) has checked shapes and dtype and
        reserved the blocks; this only copies into them.
        """
        if self._freed or self._length:
            raise InvalidRequest("migrated KV loads only into a new, empty session")
        self._foreign = True  # its blocks never join the prefix cache (issue 45)
        n = int(keys.shape[2])
        if self.num_layers and n:
            if not self.reserve(n):
                raise Rejected("the stage's KV pool is full")
            with torch.inference_mode():  # the pool's tensors may be inference tensors
                self._copy_in(keys, values, n)
        self._length = n

    def _copy_in(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        if self._base is not None:  # one run: two slice copies
            lo = self._base
            self.pool.keys[:, :, lo : lo + n] = keys.to(self.pool.device)
            self.pool.values[:, :, lo : lo + n] = values.to(self.pool.device)
            return
        assert self._slots is not None  # set with the blocks
        slots = self._slots[:n]
        self.pool.keys.index_copy_(2, slots, keys.to(self.pool.device))
        self.pool.values.index_copy_(2, slots, values.to(self.pool.device))

    def __repr__(self) -> str:
        return (
            f"SessionKV(length={self._length}, layers={self.num_layers}, "
            f"blocks={len(self.blocks)}, freed={self._freed})"
        )

    def _index(self) -> None:
        size = self.pool.block_tokens
        if not self.blocks:
            self._base = self._slots = None
            return
        if is_run(self.blocks):
            self._base, self._slots = self.blocks[0] * size, None
            return
        self._base = None
        starts = torch.tensor(self.blocks, dtype=torch.int64) * size
        offsets = torch.arange(size, dtype=torch.int64)
        self._slots = (starts[:, None] + offsets[None, :]).reshape(-1).to(self.pool.device)

    # -- used by StageModule during a forward -------------------------------------------------

    def _check_usable(self, owner: int) -> None:
        if self._freed:
            raise InvalidRequest("the session's KV cache was freed")
        if owner != self._owner:
            raise InvalidRequest("this KV cache belongs to another stage")

    def _reserve(self, extra: int) -> None:
        """Make room for ``extra`` more tokens; a stage server has reserved them already."""
        if not self.reserve(self._length + extra):
            raise Rejected(
                f"the stage's KV pool is full ({self.pool.num_blocks} blocks of "
                f"{self.pool.block_tokens} tokens)"
            )

    def _write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``(kv_heads, n, head_dim)`` after the held tokens.

        Returns all keys and values of ``layer`` including the new ones,
        ``(kv_heads, length + n, head_dim)``: a view of the pool when the
        blocks form one run, else a gathered copy. ``length`` moves on only at commit.
        """
        start, end = self._length, self._length + key.shape[1]
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # (kv_heads, slots, dim)
        if self._base is not None:
            lo = self._base
            keys[:, lo + start : lo + end] = key
            values[:, lo + start : lo + end] = value
            return keys[:, lo : lo + end], values[:, lo : lo + end]
        assert self._slots is not None  # set with the blocks
        new = self._slots[start:end]
        keys.index_copy_(1, new, key.to(keys.dtype))
        values.index_copy_(1, new, value.to(values.dtype))
        held = self._slots[:end]
        return keys.index_select(1, held), values.index_select(1, held)

    def _slot_index(self, end: int) -> torch.Tensor:
        """The pool slots of positions ``[0, end)`` (held blocks only), int64."""
        if self._base is not None:
            return torch.arange(self._base, self._base + end, device=self.pool.device)
        assert self._slots is not None  # set with the blocks
        return self._slots[:end]

    def _commit(self, n: int) -> None:
        self._length += n


__all__ = ["KVPool", "SessionKV"]
