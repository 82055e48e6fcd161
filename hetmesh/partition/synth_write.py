"""Writing synth checkpoints (:mod:`hetmesh.partition.synth`) tensor by tensor.

Two outputs, the same weights:

- a model folder, what ``--model synth-...`` resolves to: ``config.json``,
  the default model's tokenizer files and one ``model.safetensors`` in the
  compact layout a converted GGUF has (:mod:`hetmesh.partition.checkpoint`),
  its decoder matrices' Q4_1 nibbles in this CPU's packed int4 layout
  (:func:`write_folder`), or plain bf16 tensors. The safetensors header is written first (every
  tensor's size is known from the shape), then each tensor's bytes a chunk of
  rows at a time: memory holds one chunk (16 MiB of fp32), never the model;
- a GGUF file (``hetmesh model synth --gguf FILE``), written with the ``gguf``
  package's writer one tensor at a time (memory holds the largest tensor),
  with the default model's tokenizer in its metadata. Its blocks are the
  folder's bytes (the packed nibbles in Q4_1's order): a GGUF converted by
  ``--model FILE.gguf`` holds the same weights as the folder.

Before writing, the free disk is checked against the bytes to write.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from hetmesh.errors import ModelError
from hetmesh.partition.int4_direct import pack_q4_1_into, packed_suffix
from hetmesh.partition.synth import (
    EOS_ID,
    SynthSpec,
    TensorPlan,
    compact_pieces,
    draw,
    gguf_blocks,
    row_chunks,
    stored_bytes,
    stored_layout,
    synth_config,
    tensor_plans,
)

Progress = Callable[[str, float], None]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DISK_MARGIN_BYTES = 256 * 2**20  # left free beyond the checkpoint itself
NOTE = "random weights at a real model's shape: its text is noise (hetmesh model synth)"


def _quiet(phase: str, fraction: float) -> None:
    del phase, fraction


def check_disk(folder: Path, needed: int) -> None:
    """``ModelError`` if the filesystem of ``folder`` cannot hold ``needed`` more bytes."""
    free = shutil.disk_usage(folder).free
    if free < needed + DISK_MARGIN_BYTES:
        raise ModelError(
            f"not enough disk at {folder}: the checkpoint needs {needed / 1e9:.2f} GB "
            f"(+{DISK_MARGIN_BYTES / 1e9:.2f} GB spare), {free / 1e9:.2f} GB free"
        )


class _SafetensorsOut:
    """A safetensors file whose header is written first and tensors filled in by rows."""

    def __init__(
        self, path: Path, entries: Sequence[tuple[str, str, tuple[int, ...], int]]
    ) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "hetmesh_synth": NOTE}}
        self._where: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes per row)
        offset = 0
        for name, dtype, shape, nbytes in entries:
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            rows = shape[0] if len(shape) > 1 else 1
            self._where[name] = (offset, nbytes // rows)
            offset += nbytes
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._base = 8 + len(text)
        self._handle: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._handle.write(struct.pack("<Q", len(text)) + text)
        self._handle.truncate(self._base + offset)

    def write_rows(self, name: str, start: int, array: np.ndarray) -> None:
        offset, row_bytes = self._where[name]
        self._handle.seek(self._base + offset + start * row_bytes)
        self._handle.write(np.ascontiguousarray(array).tobytes())

    def close(self) -> None:
        self._handle.close()


def write_folder(
    spec: SynthSpec,
    out: Path,
    tokenizer_dir: Path,
    progress: Progress = _quiet,
    *,
    packed: bool = True,
) -> None:
    """Write ``spec``'s model folder into ``out`` (made; see the module docstring).

    With ``packed`` (the default) each decoder matrix's Q4_1 nibbles are stored in
    this CPU's packed int4 layout (``name.q4_1.int4h64``, ...;
    :mod:`hetmesh.partition.checkpoint`): an int4 stage here then reads them as they
    are, with no transform. Other readers unpack them; ``packed=False`` writes
    Q4_1's own byte order (``.q4_1.qs``), as folders before 2026-12-06 have."""
    plans = tensor_plans(spec)
    out.mkdir(parents=True)
    suffix = packed_suffix() if packed else ".q4_1.qs"
    entries = [
        (name.replace(".q4_1.qs", suffix) if _packs(plan, packed) else name, *rest)
        for plan in plans
        for name, *rest in stored_layout(plan)
    ]
    total = max(sum(plan.elements for plan in plans), 1)
    done = 0
    st = _SafetensorsOut(out / "model.safetensors", entries)  # type: ignore[arg-type]
    try:
        for plan in plans:
            pending = _Pending(plan.name + suffix) if _packs(plan, packed) else None
            for start, stop in row_chunks(plan):
                blocks = gguf_blocks(plan.kind, draw(spec.seed, plan, start, stop))
                for piece, array in compact_pieces(plan.kind, blocks).items():
                    if pending is not None and piece == ".q4_1.qs":
                        pending.add(st, array, last=stop == plan.shape[0])
                    else:
                        st.write_rows(plan.name + piece, start, array)
                done += plan.elements * (stop - start) // plan.shape[0]
                progress(f"writing {spec.name}", 0.05 + 0.9 * done / total)
    finally:
        st.close()
    _write_config(spec, out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


def _packs(plan: TensorPlan, packed: bool) -> bool:
    """Whether ``plan``'s nibbles are written packed: a decoder matrix in Q4_1 whose rows
    are whole blocks of the packed layout's 64."""
    return packed and plan.kind == "q4_1" and ".layers." in plan.name and plan.shape[0] % 64 == 0


class _Pending:
    """Q4_1 nibble rows packed and written in whole blocks of 64 rows (a drawing chunk
    need not be)."""

    def __init__(self, name: str) -> None:
        self.name, self.start = name, 0
        self.rows: np.ndarray | None = None

    def add(self, st: _SafetensorsOut, qs: np.ndarray, *, last: bool) -> None:
        import torch

        rows = qs if self.rows is None else np.concatenate([self.rows, qs])
        whole = len(rows) if last else len(rows) // 64 * 64
        if whole:
            head = torch.from_numpy(np.ascontiguousarray(rows[:whole]))
            out = torch.empty_like(head)
            pack_q4_1_into(head, out)
            st.write_rows(self.name, self.start, out.numpy())
            self.start += whole
        self.rows = rows[whole:]


def _write_config(spec: SynthSpec, out: Path) -> None:
    import transformers

    fields = synth_config(spec.shape)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.dtype = "bfloat16" if spec.fmt.value == "bf16" else "float32"
    config.save_pretrained(str(out))
    generation = transformers.GenerationConfig.from_model_config(config)
    generation.save_pretrained(str(out))


# --- GGUF -----------------------------------------------------------------------------

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """The GGUF (llama.cpp) name of a Hugging Face tensor name."""
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)  # model.layers.<i>.<part>.<weight|bias>
    part, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_GGUF_PARTS[part]}.{kind}"


def write_gguf(
    spec: SynthSpec, path: Path, tokenizer_dir: Path, progress: Progress = _quiet
) -> None:
    """Write ``spec`` as one GGUF file at ``path`` (see the module docstring)."""
    import gguf

    check_disk(path.parent, stored_bytes(spec))
    shape = spec.shape
    arch = shape.family
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(spec.name)
    writer.add_description(NOTE)
    writer.add_file_type(
        {"q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(
            spec.fmt.value, gguf.LlamaFileType.MOSTLY_BF16
        )
    )
    writer.add_vocab_size(int(synth_config(shape)["vocab_size"]))
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    _add_tokenizer(writer, tokenizer_dir)
    plans = tensor_plans(spec)
    extra = _rope_factors(spec)
    for plan in plans:
        qtype = _qtype(plan)
        nbytes = sum(n for *_, n in stored_layout(plan))
        byte_shape = (*plan.shape[:-1], nbytes // max(math.prod(plan.shape[:-1]), 1))
        if plan.kind == "f32":
            writer.add_tensor_info(gguf_name(plan.name), plan.shape, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(
                gguf_name(plan.name), byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    if extra is not None:
        writer.add_tensor_info("rope_freqs.weight", extra.shape, extra.dtype, extra.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, plan in enumerate(plans):
        parts = [gguf_blocks(plan.kind, draw(spec.seed, plan, a, b)) for a, b in row_chunks(plan)]
        data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        del parts
        if arch == "llama" and plan.name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                shape.num_attention_heads if "q_proj" in plan.name else shape.num_key_value_heads
            )
            data = _permute_rows(data, heads)
        writer.write_tensor_data(data)
        progress(f"writing {path.name}", done / len(plans))
    if extra is not None:
        writer.write_tensor_data(extra)
    writer.close()


def _qtype(plan: TensorPlan) -> Any:
    import gguf

    return {
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "f32": gguf.GGMLQuantizationType.F32,
    }[plan.kind]


def _permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's two rotary halves interleaved)."""
    half = rows.shape[0] // heads // 2
    grouped = rows.reshape(heads, 2, half, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def _rope_factors(spec: SynthSpec) -> np.ndarray | None:
    """Llama 3's rope scaling as llama.cpp stores it (``rope_freqs.weight``), if any."""
    scaling = spec.shape.rope_scaling
    if not scaling or scaling.get("rope_type") != "llama3":
        return None
    dim, base = spec.shape.head_dim, spec.shape.rope_theta
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: Any, tokenizer_dir: Path) -> None:
    """The default model's byte-level BPE tokenizer and chat template, as GGUF metadata."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = [""] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    template = tokenizer_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


__all__ = ["NOTE", "check_disk", "gguf_name", "write_folder", "write_gguf"]
