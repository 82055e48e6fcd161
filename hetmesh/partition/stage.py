"""A pipeline stage: the model's units ``[start, end)`` as one torch module.

Unit 0 is the token embedding, units ``1..L`` the decoder layers, unit
``L + 1`` the final norm and LM head (see :mod:`hetmesh.partition.profile`).
A stage is built from transformers' own decoder-layer classes on the meta
device (``accelerate.init_empty_weights``) and then materialises only its own
tensors, each already in the stage's :class:`~hetmesh.partition.formats.WeightFormat`
(:mod:`hetmesh.partition.materialise`), so a third of a model costs about a
third of its memory and a compact format never passes through a float copy
of the stage. With ``fuse`` each layer's q/k/v and gate/up weights are stacked
into one product each as it loads (:mod:`hetmesh.partition.fused`; outputs unchanged).

The node daemon calls::

    stage = load_stage(model_dir, start, end, device="cpu", weights=WeightFormat.INT8)
    stage.weights, stage.dtype               # the format; activation/KV dtype
    stage.resident_bytes()                   # bytes of its tensors
    pool = stage.new_pool(num_blocks)         # the stage's KV blocks (16 tokens each)
    kv = stage.new_kv(pool)                   # one per session (no pool: a private one)
    out = stage.forward(inputs, kv)           # one session
    outs = stage.forward_batch([(x1, kv1), (x2, kv2)])   # many: one forward per similar length

``inputs`` are int64 token ids ``(seq,)`` on a stage holding the embedding,
else hidden states ``(seq, hidden)``; the output is hidden states
``(seq, hidden)``, or logits ``(seq, vocab)`` on a stage holding the head.
Positions follow from ``kv.length``. Bad inputs raise
:class:`~hetmesh.errors.InvalidRequest` (the caller's fault, reported to the
client); failures inside torch raise :class:`~hetmesh.errors.ComputeError` or
:class:`~hetmesh.errors.DeviceOutOfMemory`.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetmesh.errors import ComputeError, DeviceOutOfMemory, InvalidRequest
from hetmesh.partition.attention import EXACT_ATTENTION, QuerySpans
from hetmesh.partition.attention import register as register_exact_attention
from hetmesh.partition.checkpoint import settle_weights
from hetmesh.partition.exact_gemm import gemm_rows
from hetmesh.partition.exact_linear import make_exact
from hetmesh.partition.formats import (
    NATIVE,
    QUANTIZED_FORMATS,
    WeightFormat,
    activation_dtype,
    bf16_int8_head,
    check_supported,
    format_of_dtype,
    is_native,
    kv_dtype,
)
from hetmesh.partition.fused import SharedProjection, fusion_default
from hetmesh.partition.kquant import KQuantEmbedding
from hetmesh.partition.kv import KVPool, SessionKV
from hetmesh.partition.lean import (
    LeanLayer,
    decode_default,
    lean_decode,
    lean_default,
    lean_layer,
    rope_tables,
)
from hetmesh.partition.lean import supports as supports_lean
from hetmesh.partition.lean_round import available as round_available
from hetmesh.partition.lean_round import round_default, round_layers
from hetmesh.partition.lean_script import ScriptPlan, decode_layers, script_default, script_plan
from hetmesh.partition.materialise import META_PATCH_LOCK, materialise
from hetmesh.partition.profile import SUPPORTED_ARCHITECTURES, model_profile
from hetmesh.partition.quant import INT4_GROUP, Int4Linear, Int8Embedding, Int8Linear
from hetmesh.partition.store import brief_error, check_model_dir
from hetmesh.partition.threads import ThreadChooser, adaptive_default
from hetmesh.resources import ModelProfile

# architecture -> (transformers module, class-name prefix)
_FAMILIES = {
    "LlamaForCausalLM": ("transformers.models.llama.modeling_llama", "Llama"),
    "MistralForCausalLM": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "Qwen2ForCausalLM": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "Qwen3ForCausalLM": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
}
# "exact" (the default): hetmesh.partition.attention, a query's result independent of the
# batch, the chunking and replays; "sdpa" and "eager": transformers' own
ATTENTION_IMPLEMENTATIONS = ("exact", "sdpa", "eager")


def _family_classes(arch: str) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
    module_name, prefix = _FAMILIES[arch]
    module = importlib.import_module(module_name)
    return (
        getattr(module, f"{prefix}DecoderLayer"),
        getattr(module, f"{prefix}RMSNorm"),
        getattr(module, f"{prefix}RotaryEmbedding"),
    )


def _sliding_window(config: Any, layer: int) -> int | None:
    """The attention window of global decoder layer ``layer`` (None = full)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return int(window) if window else None
    layer_types = getattr(config, "layer_types", None)
    if window and layer_types is not None and layer_types[layer] == "sliding_attention":
        return int(window)
    return None


# a forward pads its rows to the longest: a padded position costs what a real token
# does, and a further forward about one weight pass (a decode step: ~6 prefill tokens
# of the default model on one CPU thread); rows that would pad more than this many
# positions between them run as forwards of their own
PAD_WASTE_TOKENS = 8


def padding_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length, each one forward.

    A decode round that a new session's prefill joins would otherwise pad every
    one-token row to the prompt's length (2 decode rows beside a 36-token
    prompt: 74 tokens of work become 144). Shortest first; a group takes the
    next row while its padding stays within :data:`PAD_WASTE_TOKENS`.
    """
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        n = lengths[i]
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * n - (total + n) <= PAD_WASTE_TOKENS:
            group.append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


class _BatchCache:
    """What the stock attention layers see as their cache during one forward.

    ``update`` stores each row's new keys and values in its own session's
    KV cache and hands back the rows' full keys and values, right-padded to a
    common length (the mask hides the padding).
    """

    def __init__(self, sessions: Sequence[SessionKV], lengths: Sequence[int]) -> None:
        self.sessions = sessions
        self.lengths = lengths  # new tokens per row
        self.total = max(kv.length + n for kv, n in zip(sessions, lengths, strict=True))
        # a decode round of sessions sharing a pool (a stage server's): every layer
        # writes the rows' new keys with one scatter and reads them padded with one
        # gather, where row by row it took ~8 small ops a row (the round's overhead)
        self._decode: tuple[torch.Tensor, torch.Tensor] | None = None
        pool = sessions[0].pool
        decoding = len(sessions) > 1 and all(n == 1 for n in lengths)
        if decoding and all(kv.pool is pool for kv in sessions):
            self._decode = self._indices(sessions)

    def _indices(self, sessions: Sequence[SessionKV]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slot each row's new token goes to, (rows * total) slots to read): a row
        shorter than ``total`` reads its first slot again as padding (masked out)."""
        writes, reads = [], []
        for kv in sessions:
            slots = kv._slot_index(kv.length + 1)
            writes.append(slots[-1:])
            pad = self.total - slots.shape[0]
            reads.append(torch.cat([slots, slots[:1].expand(pad)]) if pad else slots)
        return torch.cat(writes), torch.cat(reads)

    def _decode_round(
        self, key: torch.Tensor, value: torch.Tensor, layer: int, where: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        writes, reads = where
        pool = self.sessions[0].pool
        batch, heads, _, dim = key.shape
        out = []
        for new, held in ((key, pool.keys[layer]), (value, pool.values[layer])):
            # (batch, heads, 1, dim) -> (heads, batch, dim): a slot's row per head
            held.index_copy_(1, writes, new[:, :, 0].transpose(0, 1).to(held.dtype))
            read = held.index_select(1, reads).view(heads, batch, self.total, dim)
            padded = new.new_empty((batch, heads, self.total, dim))
            padded.copy_(read.transpose(0, 1))  # widened to the activations' dtype
            out.append(padded)
        return out[0], out[1]

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: (batch, kv_heads, seq, head_dim)
        if len(self.sessions) == 1:
            k, v = self.sessions[0]._write(layer_idx, key[0], value[0])
            # a 16-bit cache is widened to the activations' dtype as it is read
            return k.unsqueeze(0).to(key.dtype), v.unsqueeze(0).to(value.dtype)
        if self._decode is not None:
            return self._decode_round(key, value, layer_idx, self._decode)
        batch, heads, _, dim = key.shape
        keys = key.new_zeros((batch, heads, self.total, dim))
        values = value.new_zeros((batch, heads, self.total, dim))
        for row, (kv, n) in enumerate(zip(self.sessions, self.lengths, strict=True)):
            k, v = kv._write(layer_idx, key[row, :, :n], value[row, :, :n])
            keys[row, :, : k.shape[1]] = k
            values[row, :, : v.shape[1]] = v
        return keys, values


class StageModule(nn.Module):
    """Units ``[start, end)`` of a decoder-only model, with per-session KV caches."""

    def __init__(
        self,
        config: Any,
        profile: ModelProfile,
        start: int,
        end: int,
        *,
        device: torch.device,
        weights: WeightFormat = WeightFormat.FLOAT32,
    ) -> None:
        super().__init__()
        self.config = config
        self.profile = profile
        self.start, self.end = start, end
        self.weights = weights
        self.device = device
        self.dtype: torch.dtype = getattr(torch, activation_dtype(weights))
        self.kv_dtype: torch.dtype = getattr(torch, kv_dtype(weights))
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_context: int = profile.max_context
        self.has_embed = start == 0
        self.has_head = end == profile.num_units
        self.layer_range = range(max(start, 1) - 1, min(end, profile.num_layers + 1) - 1)
        heads = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer_cls, norm_cls, rotary_cls = _family_classes(profile.architecture)
        quantized = weights in QUANTIZED_FORMATS
        from accelerate import init_empty_weights

        # The skeleton lives on the meta device: nothing is allocated until
        # each tensor is materialised, already in its format, by _materialise.
        # init_empty_weights patches nn.Module process-wide: two stages loading in
        # one process (in-process test meshes) take turns (META_PATCH_LOCK).
        with META_PATCH_LOCK, init_empty_weights():
            self.embed_tokens: nn.Module | None = None
            if self.has_embed:
                self.embed_tokens = (
                    Int8Embedding(config.vocab_size, config.hidden_size, device="meta")
                    if quantized
                    else nn.Embedding(config.vocab_size, config.hidden_size)
                )
            layers = []
            for local, global_index in enumerate(self.layer_range):
                # built with its global index (per-layer config such as sliding
                # windows), then renumbered: the session caches index layers locally.
                layer = layer_cls(config, global_index)
                layer.self_attn.layer_idx = local  # type: ignore[union-attr]
                if quantized:
                    _quantize_linears(layer, weights)
                layers.append(layer)
            self.layers = nn.ModuleList(layers)
            self.norm = (
                norm_cls(config.hidden_size, eps=config.rms_norm_eps) if self.has_head else None
            )
            self.lm_head: nn.Module | None = None
            if self.has_head:
                self.lm_head = (
                    Int8Linear(
                        config.hidden_size,
                        config.vocab_size,
                        bias=False,
                        device="meta",
                        # int4 multiplies in bf16 already: its head too (quant.py)
                        bf16_activations=weights is WeightFormat.INT4 and bf16_int8_head(),
                        packed=True,  # W8A8 from a packed copy where exact (quant.py)
                    )
                    if quantized
                    else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                )
        self.rotary_emb = rotary_cls(config=config).to(device) if self.layers else None
        self.windows = [_sliding_window(config, g) for g in self.layer_range]
        self._shared: list[SharedProjection] = []  # fused products (_found_fused)
        # layers computed by hetmesh.partition.lean (same bits, less per-op overhead)
        self.lean = False
        # a lean stage's lone decode token through lean.lean_decode (same bits, fewer calls)
        self.lean_decode = decode_default()
        # ... and through lean_script.decode_layers where every layer is plain int4
        self.lean_script = script_default()
        # ... and a round of several sessions' decode tokens through lean_round.round_layers
        self.lean_round = round_default()
        self._scripts: dict[tuple[int, int], ScriptPlan | None] = {}
        self._plans: list[LeanLayer] | None = None
        # decode forwards at 1 thread or the caller's count, by measurement (compact formats)
        self.threads: ThreadChooser | None = None

    def _found_fused(self) -> None:
        """Note the fused products that :func:`materialise` made (released after each forward)."""
        self._shared = [m for m in self.modules() if isinstance(m, SharedProjection)]

    def _lean_plans(self) -> list[LeanLayer]:
        """Each layer read for :func:`lean_layer` (once, at the first lean forward)."""
        if self._plans is None:
            self._plans = [LeanLayer(layer) for layer in self.layers]
        return self._plans

    @property
    def fused(self) -> bool:
        return bool(self._shared)

    # -- introspection ------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def param_count(self) -> int:
        """Parameters held (a tied embedding shared with the head counted once).

        Counts weights, not their storage: an int8 or int4 matrix counts its
        logical elements; scales and zero points are not counted.
        """
        total = sum(p.numel() for p in self.parameters())
        for module in self.modules():
            if isinstance(module, (Int8Linear, Int4Linear)):
                total += module.in_features * module.out_features
        if isinstance(self.embed_tokens, Int8Embedding):
            total += self.embed_tokens.weight_q.numel()
            if isinstance(self.lm_head, Int8Linear) and (
                self.lm_head.weight_q is self.embed_tokens.weight_q
            ):
                total -= self.embed_tokens.weight_q.numel()  # one shared matrix
        elif isinstance(self.embed_tokens, KQuantEmbedding):  # kept as its GGUF blocks
            total += self.embed_tokens.num_embeddings * self.embed_tokens.dim
        return total

    def resident_bytes(self) -> int:
        """Bytes of every tensor this stage holds (shared tensors once; accelerate's count),
        with an int head's packed copy (made at its first call)."""
        from accelerate.utils import compute_module_sizes

        packed = self.lm_head.packed_bytes() if isinstance(self.lm_head, Int8Linear) else 0
        return int(compute_module_sizes(self)[""]) + packed

    def new_pool(self, num_blocks: int) -> KVPool:
        """A fixed pool of ``num_blocks`` KV blocks for this stage's layers (a stage server's)."""
        return KVPool(
            num_blocks=num_blocks,
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )

    def new_kv(self, pool: KVPool | None = None) -> SessionKV:
        """A fresh, empty KV cache for one session on this stage.

        Its blocks come from ``pool``; without one, from a private pool that grows.
        """
        if pool is None:
            pool = KVPool(
                num_blocks=0,
                num_layers=self.num_layers,
                kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                dtype=self.kv_dtype,
                device=self.device,
                growable=True,
            )
        elif (pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype) != (
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            self.kv_dtype,
        ):
            raise InvalidRequest("this KV pool was made for another stage")
        return SessionKV(owner=id(self), pool=pool, max_length=self.max_context)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize

    def extra_repr(self) -> str:
        return (
            f"units=[{self.start}, {self.end}), layers={list(self.layer_range)}, "
            f"weights={self.weights}"
        )

    # -- compute ------------------------------------------------------------------------

    def forward(  # type: ignore[override]
        self, inputs: torch.Tensor, kv: SessionKV, *, last_only: bool = False
    ) -> torch.Tensor:
        """Run one session's chunk; see the module docstring for shapes."""
        outputs: list[torch.Tensor] = self.forward_batch([(inputs, kv)], last_only=last_only)
        return outputs[0]

    def forward_batch(
        self,
        items: Sequence[tuple[torch.Tensor, SessionKV]],
        *,
        last_only: bool = False,
        heads: Sequence[bool] | None = None,
        spans: Sequence[tuple[int, int] | None] | None = None,
    ) -> list[torch.Tensor]:
        """Run several sessions' chunks (any lengths, any KV lengths) together: one
        forward for chunks of similar length (see :func:`padding_groups`).

        Returns one output per item, in order. With ``last_only`` a head stage
        returns logits of each chunk's last token only, ``(1, vocab)``. ``heads``
        (one per item) skips a head stage's head where False: that item returns no
        logits, ``(0, vocab)`` (a prefill chunk that samples nothing). ``spans`` (one
        per item, None: the whole stage) runs an item through units ``[lo, hi)`` of
        the stage only (a prefill split between two peers holding the same units,
        see :mod:`hetmesh.node.split`): it takes token ids where ``lo`` is the
        embedding, else hidden states, and writes its KV in those units' layers only.
        """
        if not items:
            return []
        if heads is not None and len(heads) != len(items):
            raise InvalidRequest(f"{len(heads)} head flags for {len(items)} items")
        if spans is not None and len(spans) != len(items):
            raise InvalidRequest(f"{len(spans)} unit spans for {len(items)} items")
        ranges = [self._span(None if spans is None else spans[i]) for i in range(len(items))]
        prepared = [
            self._check_input(x, kv, lo) for (x, kv), (lo, _) in zip(items, ranges, strict=True)
        ]
        sessions = [kv for _, kv in items]
        if len({id(kv) for kv in sessions}) != len(sessions):
            raise InvalidRequest("a session appears twice in one batch")
        outputs: list[torch.Tensor] = [torch.empty(0)] * len(prepared)
        cap = torch.get_num_threads()
        decoding = self.threads is not None and all(x.shape[0] == 1 for x in prepared)
        count = self.threads.count(cap) if self.threads is not None and decoding else cap
        if count != cap:
            torch.set_num_threads(count)
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                for span in dict.fromkeys(ranges):  # one forward per span, in order of first
                    rows = [i for i, r in enumerate(ranges) if r == span]
                    for part in padding_groups([prepared[i].shape[0] for i in rows]):
                        group = [rows[j] for j in part]
                        results = self._run(
                            [prepared[i] for i in group],
                            [sessions[i] for i in group],
                            last_only,
                            None if heads is None else [heads[i] for i in group],
                            span,
                        )
                        for i, result in zip(group, results, strict=True):
                            outputs[i] = result
        except torch.OutOfMemoryError as exc:
            raise DeviceOutOfMemory(
                f"stage [{self.start}, {self.end}): {brief_error(exc)}"
            ) from exc
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ComputeError(
                f"stage [{self.start}, {self.end}) failed: {brief_error(exc)}"
            ) from exc
        finally:
            if count != cap:
                torch.set_num_threads(cap)  # the caller's count, as it set it
            for shared in self._shared:  # hold no activations between forwards
                shared.release()
        if self.threads is not None and decoding:
            self.threads.record(count, (time.perf_counter() - began) / len(prepared))
        for kv, x in zip(sessions, prepared, strict=True):
            kv._commit(x.shape[0])
        return outputs

    def _span(self, span: tuple[int, int] | None) -> tuple[int, int]:
        """``span`` checked against the stage's units (None: all of them)."""
        if span is None:
            return self.start, self.end
        lo, hi = span
        if not self.start <= lo < hi <= self.end:
            raise InvalidRequest(
                f"units [{lo}, {hi}) are not within stage [{self.start}, {self.end})"
            )
        return lo, hi

    def layer_slice(self, lo: int, hi: int) -> slice:
        """The stage's (local) layers of its units ``[lo, hi)``."""
        first = self.layer_range.start
        unit_layers = range(max(lo, 1) - 1, min(hi, self.profile.num_layers + 1) - 1)
        return slice(max(0, unit_layers.start - first), max(0, unit_layers.stop - first))

    def _check_input(self, x: Any, kv: Any, lo: int | None = None) -> torch.Tensor:
        if not isinstance(kv, SessionKV):
            raise InvalidRequest(f"expected a SessionKV, got {type(kv).__name__}")
        kv._check_usable(id(self))
        if not isinstance(x, torch.Tensor):
            raise InvalidRequest(f"expected a tensor, got {type(x).__name__}")
        if self.has_embed and (lo is None or lo == 0):
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 1:
                raise InvalidRequest(
                    f"first stage takes int64 token ids of shape (seq,), got {x.dtype} "
                    f"{tuple(x.shape)}"
                )
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.vocab_size):
                raise InvalidRequest(f"token id outside the vocabulary [0, {self.vocab_size})")
            x = x.to(self.device, torch.int64)
        else:
            if not x.is_floating_point() or x.dim() != 2 or x.shape[1] != self.hidden_size:
                raise InvalidRequest(
                    f"units [{self.start if lo is None else lo}, {self.end}) take hidden "
                    f"states (seq, {self.hidden_size}), got {x.dtype} {tuple(x.shape)}"
                )
            x = x.to(self.device, self.dtype)
        if x.shape[0] == 0:
            raise InvalidRequest("empty input chunk")
        if kv.length + x.shape[0] > self.max_context:
            raise InvalidRequest(
                f"context of {kv.length + x.shape[0]} tokens exceeds the model's "
                f"maximum of {self.max_context}"
            )
        checked: torch.Tensor = x
        return checked

    def _run(
        self,
        xs: list[torch.Tensor],
        sessions: list[SessionKV],
        last_only: bool,
        heads: Sequence[bool] | None = None,
        span: tuple[int, int] | None = None,
    ) -> list[torch.Tensor]:
        lo, hi = span or (self.start, self.end)
        lengths = [x.shape[0] for x in xs]
        batch, width = len(xs), max(lengths)
        if self.embed_tokens is not None and lo == 0:
            ids = torch.zeros((batch, width), dtype=torch.int64, device=self.device)
            for row, x in enumerate(xs):
                ids[row, : x.shape[0]] = x
            hidden = self.embed_tokens(ids)  # (batch, seq, hidden)
        else:
            hidden = torch.zeros(
                (batch, width, self.hidden_size), dtype=self.dtype, device=self.device
            )
            for row, x in enumerate(xs):
                hidden[row, : x.shape[0]] = x

        part = self.layer_slice(lo, hi)
        # a list, not the ModuleList's slice (a new module and 30 add_module calls a step)
        layers, windows = list(self.layers)[part], self.windows[part]
        if layers:
            for kv, n in zip(sessions, lengths, strict=True):
                kv._reserve(n)
            past = torch.tensor([kv.length for kv in sessions], device=self.device)
            position_ids = past[:, None] + torch.arange(width, device=self.device)[None, :]
            position_embeddings = self.rotary_emb(hidden, position_ids)  # type: ignore[misc]
            rope = rope_tables(position_embeddings) if self.lean else None
            plans = self._lean_plans()[part] if self.lean else []
            if rope is not None and self._decodes_lean(sessions, lengths, plans):
                hidden = self._lean_decode(plans, windows, hidden, sessions[0], rope)
            elif rope is not None and (script := self._round_plan(sessions, lengths, plans)):
                gemm = self._gemm_rows()
                hidden = round_layers(script, hidden[:, 0], sessions, windows, *rope, gemm)[:, None]
            else:
                cache = _BatchCache(sessions, lengths)
                masks: dict[int | None, torch.Tensor | QuerySpans | None] = {}
                for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
                    if window not in masks:
                        masks[window] = self._mask(past, lengths, position_ids, cache.total, window)
                    mask = masks[window]
                    if rope is not None and isinstance(mask, QuerySpans):
                        hidden = lean_layer(plans[i], hidden, mask, cache, *rope)
                        continue
                    hidden = layer(
                        hidden,
                        attention_mask=masks[window],
                        position_ids=position_ids,
                        cache=cache,
                        use_cache=True,
                        position_embeddings=position_embeddings,
                    )  # (batch, seq, hidden)

        if self.norm is not None and self.lm_head is not None and hi == self.end:
            keep = [row for row in range(batch) if heads is None or heads[row]]
            none = hidden.new_empty((0, self.vocab_size))
            if not keep:
                return [none] * batch
            if last_only and width == 1 and len(keep) == batch:
                kept_lengths = [1] * batch  # one token a row: already (kept, 1, hidden)
            elif last_only:
                rows = torch.tensor(keep, device=self.device)
                last = torch.tensor([lengths[row] for row in keep], device=self.device) - 1
                hidden = hidden[rows, last][:, None, :]  # (kept, 1, hidden)
                kept_lengths = [1] * len(keep)
            else:
                hidden = hidden if len(keep) == batch else hidden[keep]
                kept_lengths = [lengths[row] for row in keep]
            logits = self.lm_head(self.norm(hidden))  # (kept, seq, vocab)
            outputs = [none] * batch
            for j, (row, n) in enumerate(zip(keep, kept_lengths, strict=True)):
                outputs[row] = logits[j, :n]
            return outputs
        return [hidden[row, :n] for row, n in enumerate(lengths)]

    def _decodes_lean(
        self, sessions: list[SessionKV], lengths: list[int], plans: list[LeanLayer]
    ) -> bool:
        """Whether this forward is one session's decode token that :func:`lean_decode`
        computes: its KV blocks one run, exact attention, every product int4."""
        return (
            self.lean_decode
            and lengths == [1]
            and sessions[0]._base is not None
            and self.dtype == torch.float32
            and self.config._attn_implementation == EXACT_ATTENTION
            and all(plan.int4 for plan in plans)
        )

    def _round_plan(
        self, sessions: list[SessionKV], lengths: list[int], plans: list[LeanLayer]
    ) -> ScriptPlan | None:
        """The script plan where this forward is a decode round that :func:`round_layers`
        computes (one pool, exact attention by exact_gemm's products, every layer plain
        or fused int4), else None: several sessions, or one whose KV blocks do not form
        one run (:meth:`_lean_decode` takes those that do; a stage server's sessions
        interleave their blocks as they grow)."""
        if not (
            self.lean_round
            and (len(lengths) > 1 or sessions[0]._base is None)
            and all(n == 1 for n in lengths)
            and all(kv.pool is sessions[0].pool for kv in sessions)
            and self.dtype == torch.float32
            and self.device.type == "cpu"
            and self.config._attn_implementation == EXACT_ATTENTION
            and all(plan.int4 for plan in plans)
            and self._gemm()
            and round_available()
        ):
            return None
        return self._script_plan(plans)

    def _lean_decode(
        self,
        plans: list[LeanLayer],
        windows: list[int | None],
        hidden: torch.Tensor,
        kv: SessionKV,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The layers of ``plans`` for one decode token ``hidden (1, 1, h)`` of ``kv``."""
        base, position = kv._base, kv.length
        assert base is not None  # _decodes_lean checked
        pool = (kv.pool.keys, kv.pool.values)
        # each layer's first key: QuerySpans.of's, offset by the run's first slot
        starts = [base + (0 if w is None else max(0, position - w + 1)) for w in windows]
        end = base + position + 1
        row = hidden[0]
        script = self._script_plan(plans) if self.lean_script else None
        if script is not None:  # attention as exact attention computes it for this shape
            rows = self._gemm_rows()
            row = decode_layers(script, row, pool, end - 1, starts, end, *rope, base, rows)
            return row[None]
        for plan, start in zip(plans, starts, strict=True):
            row = lean_decode(plan, row, pool, end - 1, (start, end), *rope, first=base)
        return row[None]

    def _gemm(self) -> bool:
        """Whether exact attention takes :mod:`~hetmesh.partition.exact_gemm` here."""
        return self._gemm_rows() > 0

    def _gemm_rows(self) -> int:
        """Rows per product of exact attention's products here, 0 where it makes one call
        per query (:func:`~hetmesh.partition.exact_gemm.gemm_rows`)."""
        config = self.config
        heads = config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return gemm_rows(heads, config.num_key_value_heads, dim)

    def _script_plan(self, plans: list[LeanLayer]) -> ScriptPlan | None:
        """:func:`script_plan` of these layers (read once per run of layers)."""
        key = (plans[0].index, plans[-1].index) if plans else (0, -1)
        if key not in self._scripts:
            self._scripts[key] = script_plan(plans)
        return self._scripts[key]

    def _mask(
        self,
        past: torch.Tensor,
        lengths: list[int],
        position_ids: torch.Tensor,
        total: int,
        window: int | None,
    ) -> torch.Tensor | QuerySpans | None:
        """What the attention layers take as their mask: the queries' key spans for exact
        attention, else an additive mask ``(batch, 1, seq, total)`` (None where sdpa's
        own works)."""
        implementation = self.config._attn_implementation
        if implementation == EXACT_ATTENTION:
            return QuerySpans.of(past.tolist(), lengths, position_ids.shape[1], window)
        single = len(lengths) == 1
        past_len, n = int(past[0]), lengths[0]
        simple = past_len == 0 or n == 1  # plain causal, or attend to everything
        if (
            single
            and simple
            and implementation == "sdpa"
            and (window is None or past_len + n <= window)
        ):
            return None
        keys = torch.arange(total, device=self.device)[None, None, :]
        queries = position_ids[:, :, None]  # absolute position of each query
        ends = (past + torch.tensor(lengths, device=self.device))[:, None, None]
        allowed = (keys <= queries) & (keys < ends)
        if window is not None:
            allowed &= queries - keys < window
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]  # padded query rows still see key 0: no NaN rows


def load_stage(
    model_dir: str | os.PathLike[str],
    start: int,
    end: int,
    *,
    device: str | torch.device = "cpu",
    weights: WeightFormat | str = NATIVE,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    fuse: bool | None = None,
    transpose_head: bool | None = None,
    exact_linears: bool | None = None,
) -> StageModule:
    """Build the stage for units ``[start, end)`` and load only its tensors, in ``weights``.

    ``dtype`` is the older spelling of the float formats (``torch.bfloat16``
    means ``weights="bfloat16"``); pass one or the other. Raises
    ``ModelNotFound``/``UnsupportedModel``/``CorruptModel`` for a bad folder
    and ``InvalidRequest`` for a range outside the model or a format the
    device or model cannot hold.

    ``attn_implementation``: None is ``"exact"`` on a CPU (a query's result independent
    of its batch, chunks and replays; :mod:`hetmesh.partition.attention`) and ``"sdpa"``
    elsewhere (a GPU's matrix products are not row-invariant either: one attention call
    per query would cost launches and buy nothing).

    ``fuse`` stacks the projections that share an input into one product each
    (:mod:`hetmesh.partition.fused`; outputs unchanged); ``None`` follows the
    ``HETMESH_FUSED_PROJECTIONS`` switch (off unless it is ``1``).

    ``transpose_head`` stores an fp32 LM head column-major (a tied embedding shared
    with it too; the same bytes); ``None`` follows ``HETMESH_TRANSPOSED_HEAD`` (on
    unless it is ``0``).

    ``exact_linears`` computes the float formats' linear layers so that a row's result
    does not depend on the call's other rows (:mod:`hetmesh.partition.exact_linear`);
    ``None``: where the attention is ``"exact"``, unless ``HETMESH_EXACT_LINEARS`` is
    ``0`` (float32's prefill then costs what it did, and its rows follow their calls:
    set it alike on every node and in the process compared with them).
    """
    import transformers

    folder = Path(model_dir)
    config_dict = check_model_dir(folder)
    if attn_implementation is None:
        attn_implementation = "exact" if torch.device(device).type == "cpu" else "sdpa"
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise InvalidRequest(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}")
    torch_device = torch.device(device)
    if dtype is not None:
        if not is_native(str(weights)) and WeightFormat(weights) is not WeightFormat.FLOAT32:
            raise InvalidRequest("pass weights= or dtype=, not both")
        fmt = format_of_dtype(dtype)
    else:
        fmt = settle_weights(str(weights), folder, torch_device.type) or WeightFormat.FLOAT32
    check_supported(fmt, torch_device.type)
    try:
        profile = model_profile(config_dict, weights=fmt, name=folder.name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    if not (
        isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= profile.num_units
    ):
        raise InvalidRequest(f"unit range [{start}, {end}) outside [0, {profile.num_units})")
    config = transformers.AutoConfig.from_pretrained(str(folder))
    # unset means non-causal attention
    config._attn_implementation = (
        register_exact_attention() if attn_implementation == "exact" else attn_implementation
    )
    if fmt is WeightFormat.INT4:
        widths = {config.hidden_size, config.intermediate_size}
        widths.add(config.num_attention_heads * (getattr(config, "head_dim", None) or 0))
        if any(w % INT4_GROUP for w in widths if w):
            raise InvalidRequest(
                f"int4 needs layer widths that are multiples of {INT4_GROUP}; this model has "
                f"{sorted(w for w in widths if w)}"
            )
    stage = StageModule(config, profile, start, end, device=torch_device, weights=fmt)
    # Why column-major: F.linear(x, W) multiplies by W.t(); with W.t() contiguous
    # the CPU kernel streams the default model's 49,152 x 576 head about twice as
    # fast for one decode row (docs/benchmarks.md, issue 16). Not the row-major
    # product's logits to the last bit (another reduction order, ~2e-6 relative):
    # greedy tokens are checked against it by tests and every bench/decode.py run.
    if exact_linears is None:
        exact_linears = attn_implementation == "exact" and exact_linears_default()
    # (exact linear layers never make the 1-row call it speeds; on AMD's EPYC their
    # few rows' calls stream a row-major head faster: exact_linear.HEAD_SLICE)
    column_major = fmt is WeightFormat.FLOAT32 and (
        transposed_head_default() and not (exact_linears and torch_device.type == "cpu")
        if transpose_head is None
        else transpose_head
    )
    materialise(
        stage,
        folder,
        config_dict,
        fuse=fusion_default() if fuse is None else fuse,
        column_major_head=column_major,
    )
    stage._found_fused()
    if fmt in QUANTIZED_FORMATS and torch_device.type == "cpu" and adaptive_default():
        stage.threads = ThreadChooser()
    stage.lean = (
        lean_default()
        and attn_implementation == "exact"
        and torch_device.type == "cpu"
        and all(supports_lean(layer) for layer in stage.layers)
    )
    if exact_linears:
        make_exact(stage)
    stage.eval()
    return stage


TRANSPOSED_HEAD_ENV = "HETMESH_TRANSPOSED_HEAD"
EXACT_LINEARS_ENV = "HETMESH_EXACT_LINEARS"


def exact_linears_default() -> bool:
    """Whether float stages tile their linear layers when the caller does not say (env)."""
    return os.environ.get(EXACT_LINEARS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def transposed_head_default() -> bool:
    """Whether fp32 heads are stored column-major when the caller does not say (env switch)."""
    return os.environ.get(TRANSPOSED_HEAD_ENV, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _quantize_linears(layer: nn.Module, fmt: WeightFormat) -> None:
    """Swap a decoder layer's seven linear layers for int8/int4 ones (on meta)."""
    cls = Int8Linear if fmt is WeightFormat.INT8 else Int4Linear
    for parent_name in ("self_attn", "mlp"):
        parent = getattr(layer, parent_name)
        for name in _LINEAR_NAMES:
            linear = getattr(parent, name, None)
            if isinstance(linear, nn.Linear):
                setattr(
                    parent,
                    name,
                    cls(
                        linear.in_features,
                        linear.out_features,
                        bias=linear.bias is not None,
                        device="meta",
                    ),
                )


_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "EXACT_LINEARS_ENV",
    "PAD_WASTE_TOKENS",
    "SUPPORTED_ARCHITECTURES",
    "TRANSPOSED_HEAD_ENV",
    "StageModule",
    "exact_linears_default",
    "load_stage",
    "padding_groups",
    "transposed_head_default",
]
