"""Seeded random checkpoints at the shapes of real architectures (``hetmesh model synth``).

A synth model has every dimension of a real model (hidden size, layers, heads,
KV heads, MLP width, rope, tied or untied head) and **noise for weights**: its
text is gibberish. It exists to measure what serving and cutting a model of a
size people join a mesh for costs (memory, load time, activations, KV,
prefill), without downloading gigabytes of real weights. Its vocabulary is
the default model's (SmolLM2's 49,152 words) and its tokenizer and chat
template are the default model's, so every prompt tokenises as usual.

A name says what it is: ``synth-<shape>[-<format>][-seed<N>]``, e.g.
``synth-llama-3.2-1b`` (Q4_1 blocks, seed 0), ``synth-llama-3.1-8b-bf16``,
``synth-qwen2.5-7b-q8_0-seed7``.

Weights are drawn per tensor, per chunk of rows, from a generator seeded by
``sha256(seed, tensor name, chunk)``: the same seed gives the same bytes, in
any order of writing. They are uniform with a standard deviation chosen so
hidden states stay of order one through every layer (pre-norm blocks, the
residual outputs ``o_proj`` and ``down_proj`` scaled by ``1/sqrt(2 layers)``,
so the stream's RMS grows to about :data:`RESIDUAL_RMS` whatever the depth)
and the logits have a standard deviation of about :data:`LOGIT_STD`. The
head's rows of the tokenizer's special words are zero, so greedy generation
never ends early: a benchmark gets the tokens it asks for.

Pure: numpy and the ``gguf`` package's reference quantisers, no torch. The
writers are in :mod:`hetmesh.partition.synth_write`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import numpy as np

from hetmesh.errors import ModelNotFound

PREFIX = "synth-"
VOCAB_SIZE = 49_152  # the default model's (SmolLM2) tokenizer
BOS_ID, EOS_ID = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>
LOGIT_STD = 4.0  # the head's logits: wide enough that greedy choices are clear
# The residual stream's RMS after the last layer (about): each of the 2 x layers
# branches adds RESIDUAL_RMS / sqrt(2 layers). Well above LOGIT_STD / 4 so a tied
# head does not just predict the input token back (its own embedding row).
RESIDUAL_RMS = 8.0
BIAS_STD = 0.1
SPECIAL_IDS = 17  # SmolLM2's special words (ids 0..16): zero rows in the head
BLOCK = 32  # inputs per GGUF Q4_1 / Q8_0 block
CHUNK_ELEMENTS = 1 << 22  # values drawn (and quantised) at once: 16 MiB of fp32
_SEED_DOMAIN = b"hetmesh-synth-v1"

Kind = Literal["q4_1", "q8_0", "bf16", "f32"]

_LLAMA3_1B_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_8B_ROPE = {**_LLAMA3_1B_ROPE, "factor": 8.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthShape:
    """The dimensions of one architecture (its own config values, but the vocabulary)."""

    name: str
    copies: str  # the real model whose shape this is
    family: Literal["llama", "qwen2"]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool
    max_position_embeddings: int
    rms_norm_eps: float
    for_tests: bool = False


SHAPES: dict[str, SynthShape] = {
    s.name: s
    for s in (
        SynthShape(
            name="synth-llama-3.2-1b",
            copies="meta-llama/Llama-3.2-1B",
            family="llama",
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            rope_theta=500_000.0,
            rope_scaling=_LLAMA3_1B_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
        ),
        SynthShape(
            name="synth-llama-3.2-3b",
            copies="meta-llama/Llama-3.2-3B",
            family="llama",
            hidden_size=3072,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=8192,
            rope_theta=500_000.0,
            rope_scaling=_LLAMA3_1B_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
        ),
        SynthShape(
            name="synth-llama-3.1-8b",
            copies="meta-llama/Llama-3.1-8B",
            family="llama",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14_336,
            rope_theta=500_000.0,
            rope_scaling=_LLAMA3_8B_ROPE,
            tie_word_embeddings=False,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
        ),
        SynthShape(
            name="synth-qwen2.5-7b",
            copies="Qwen/Qwen2.5-7B-Instruct",
            family="qwen2",
            hidden_size=3584,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=18_944,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            max_position_embeddings=32_768,
            rms_norm_eps=1e-6,
        ),
        # tiny shapes for tests: the same code paths in milliseconds
        SynthShape(
            name="synth-tiny",
            copies="a Llama 3.2 shrunk to 4 layers of 64 (tests)",
            family="llama",
            hidden_size=64,
            num_hidden_layers=4,
            # one head of 64: 32 rope frequencies, so the llama3 scaling's transition
            # band holds several and survives a GGUF's rope_freqs (16 leave one there)
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=128,
            rope_theta=500_000.0,
            rope_scaling=_LLAMA3_1B_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
            for_tests=True,
        ),
        SynthShape(
            name="synth-tiny-qwen2",
            copies="a Qwen2.5 shrunk to 3 layers of 64 (tests)",
            family="qwen2",
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            max_position_embeddings=32_768,
            rms_norm_eps=1e-6,
            for_tests=True,
        ),
    )
}


class SynthFormat(StrEnum):
    """How a synth checkpoint stores its matrices."""

    Q4_1 = "q4_1"  # decoder matrices in GGUF Q4_1 blocks, embedding/head Q8_0, norms fp32
    Q8_0 = "q8_0"  # every matrix in GGUF Q8_0 blocks, norms fp32
    BF16 = "bf16"  # every tensor bf16 (a Hugging Face folder as published)


DEFAULT_FORMAT = SynthFormat.Q4_1


@dataclass(frozen=True, slots=True)
class SynthSpec:
    """One synth checkpoint: a shape, a format and a seed (what its name spells)."""

    shape: SynthShape
    fmt: SynthFormat = DEFAULT_FORMAT
    seed: int = 0

    @property
    def name(self) -> str:
        text = self.shape.name
        if self.fmt is not DEFAULT_FORMAT:
            text += f"-{self.fmt.value}"
        if self.seed:
            text += f"-seed{self.seed}"
        return text


_NAME = re.compile(r"^(?P<shape>.+?)(?:-(?P<fmt>q4_1|q8_0|bf16))?(?:-seed(?P<seed>\d+))?$")


def is_synth_name(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_synth_name(text: str) -> SynthSpec:
    """The spec a synth name spells; ``ModelNotFound`` listing the shapes if none."""
    found = _NAME.match(text)
    shape = SHAPES.get(found.group("shape")) if found else None
    if found is None or shape is None:
        names = ", ".join(s for s, v in SHAPES.items() if not v.for_tests)
        raise ModelNotFound(
            f"unknown synth model {text!r}: expected synth-<shape>[-q4_1|-q8_0|-bf16]"
            f"[-seed<N>] with a shape among {names}"
        )
    fmt = SynthFormat(found.group("fmt") or DEFAULT_FORMAT.value)
    return SynthSpec(shape, fmt, int(found.group("seed") or 0))


def matrix_kind(spec: SynthSpec) -> str:
    """How ``spec`` stores its decoder's matrices, as
    :func:`~hetmesh.partition.checkpoint.stored_matrix_kind` names it."""
    return "bfloat16" if spec.fmt is SynthFormat.BF16 else spec.fmt.value


def synth_config(shape: SynthShape) -> dict[str, Any]:
    """The Hugging Face config fields of ``shape`` (transformers fills in the rest)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if shape.family == "llama" else "Qwen2ForCausalLM"],
        "model_type": shape.family,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    }
    if shape.rope_scaling is not None:
        config["rope_scaling"] = dict(shape.rope_scaling)
    if shape.family == "qwen2":
        config["use_sliding_window"] = False
    return config


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One logical tensor: its Hugging Face name, shape, stored kind and values' spread."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    std: float  # uniform noise of this standard deviation; 0 with fill: a constant
    fill: float = 0.0
    zero_rows: int = 0  # rows [0, zero_rows) are zero (the head's special words)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def tensor_plans(spec: SynthSpec) -> list[TensorPlan]:
    """Every tensor of ``spec``'s checkpoint, sorted by name."""
    s = spec.shape
    h, inter, layers = s.hidden_size, s.intermediate_size, s.num_hidden_layers
    q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    matrices: dict[SynthFormat, Kind] = {
        SynthFormat.Q4_1: "q4_1",
        SynthFormat.Q8_0: "q8_0",
        SynthFormat.BF16: "bf16",
    }
    matrix = matrices[spec.fmt]
    table: Kind = "bf16" if spec.fmt is SynthFormat.BF16 else "q8_0"
    vector: Kind = "bf16" if spec.fmt is SynthFormat.BF16 else "f32"
    residual = RESIDUAL_RMS / math.sqrt(2 * layers)
    table_std = LOGIT_STD / math.sqrt(h)
    tied = s.tie_word_embeddings
    plans = [
        TensorPlan(
            "model.embed_tokens.weight",
            (VOCAB_SIZE, h),
            table,
            table_std,
            zero_rows=SPECIAL_IDS if tied else 0,
        ),
        TensorPlan("model.norm.weight", (h,), vector, 0.0, fill=1.0),
    ]
    if not tied:
        head = TensorPlan(
            "lm_head.weight", (VOCAB_SIZE, h), table, table_std, zero_rows=SPECIAL_IDS
        )
        plans.append(head)
    for i in range(layers):
        p = f"model.layers.{i}."
        plans += [
            TensorPlan(p + "input_layernorm.weight", (h,), vector, 0.0, fill=1.0),
            TensorPlan(p + "post_attention_layernorm.weight", (h,), vector, 0.0, fill=1.0),
            TensorPlan(p + "self_attn.q_proj.weight", (q_out, h), matrix, 1 / math.sqrt(h)),
            TensorPlan(p + "self_attn.k_proj.weight", (kv_out, h), matrix, 1 / math.sqrt(h)),
            TensorPlan(p + "self_attn.v_proj.weight", (kv_out, h), matrix, 1 / math.sqrt(h)),
            TensorPlan(
                p + "self_attn.o_proj.weight", (h, q_out), matrix, residual / math.sqrt(q_out)
            ),
            TensorPlan(p + "mlp.gate_proj.weight", (inter, h), matrix, 1 / math.sqrt(h)),
            TensorPlan(p + "mlp.up_proj.weight", (inter, h), matrix, 1 / math.sqrt(h)),
            TensorPlan(p + "mlp.down_proj.weight", (h, inter), matrix, residual / math.sqrt(inter)),
        ]
        if s.family == "qwen2":  # Qwen2 attention carries q, k and v biases
            for proj, width in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                plans.append(
                    TensorPlan(p + f"self_attn.{proj}_proj.bias", (width,), vector, BIAS_STD)
                )
    return sorted(plans, key=lambda t: t.name)


def row_chunks(plan: TensorPlan) -> Iterator[tuple[int, int]]:
    """The ``[start, stop)`` row ranges ``plan`` is drawn in (a 1-D tensor: one)."""
    if len(plan.shape) == 1:
        yield 0, plan.shape[0]
        return
    rows, cols = plan.shape
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def draw(seed: int, plan: TensorPlan, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``plan`` as fp32 (one of :func:`row_chunks`' ranges)."""
    shape = (stop - start, *plan.shape[1:])
    if plan.std == 0.0:
        return np.full(shape, plan.fill, dtype=np.float32)
    material = b"\0".join([_SEED_DOMAIN, str(seed).encode(), plan.name.encode(), b"%d" % start])
    digest = hashlib.sha256(material).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
    values = rng.random(shape, dtype=np.float32)
    half_width = np.float32(plan.std * math.sqrt(3.0))  # uniform on [-a, a]: std a/sqrt(3)
    values *= 2 * half_width
    values -= half_width
    if plan.fill:
        values += np.float32(plan.fill)
    if start < plan.zero_rows:
        values[: plan.zero_rows - start] = 0.0
    return values


def gguf_blocks(kind: Kind, values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` in GGUF's bytes for ``kind`` (the ``gguf`` package's quantiser)."""
    import gguf

    if kind == "f32":
        return values.astype(np.float32, copy=False)
    qtype = {
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "bf16": gguf.GGMLQuantizationType.BF16,
    }[kind]
    return np.asarray(gguf.quants.quantize(values, qtype))


def compact_pieces(kind: Kind, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF bytes of some rows split into the compact folder's tensors (suffix -> array):
    ``.q4_1.qs/.d/.m`` or ``.q8_0.qs/.d`` (see :mod:`hetmesh.partition.checkpoint`);
    a float kind is one array under the suffix ``""`` (bf16 as its raw uint16 bits)."""
    if kind == "f32":
        return {"": blocks}
    if kind == "bf16":
        return {"": blocks.view(np.uint16)}
    rows = blocks.shape[0]
    size = 20 if kind == "q4_1" else 34
    grouped = blocks.reshape(rows, -1, size)
    d = np.ascontiguousarray(grouped[..., 0:2]).view(np.float16).reshape(rows, -1)
    if kind == "q8_0":
        qs = np.ascontiguousarray(grouped[..., 2:34]).view(np.int8).reshape(rows, -1)
        return {".q8_0.qs": qs, ".q8_0.d": d}
    m = np.ascontiguousarray(grouped[..., 2:4]).view(np.float16).reshape(rows, -1)
    qs = np.ascontiguousarray(grouped[..., 4:20]).reshape(rows, -1)
    return {".q4_1.qs": qs, ".q4_1.d": d, ".q4_1.m": m}


def stored_layout(plan: TensorPlan) -> list[tuple[str, str, tuple[int, ...], int]]:
    """The compact folder's tensors for ``plan``: (name, safetensors dtype, shape, bytes)."""
    if plan.kind in ("f32", "bf16"):
        width = 4 if plan.kind == "f32" else 2
        return [(plan.name, plan.kind.upper(), plan.shape, plan.elements * width)]
    rows, cols = plan.shape
    groups = cols // BLOCK
    if plan.kind == "q8_0":
        return [
            (plan.name + ".q8_0.d", "F16", (rows, groups), rows * groups * 2),
            (plan.name + ".q8_0.qs", "I8", (rows, cols), rows * cols),
        ]
    return [
        (plan.name + ".q4_1.d", "F16", (rows, groups), rows * groups * 2),
        (plan.name + ".q4_1.m", "F16", (rows, groups), rows * groups * 2),
        (plan.name + ".q4_1.qs", "U8", (rows, cols // 2), rows * cols // 2),
    ]


def stored_bytes(spec: SynthSpec) -> int:
    """Bytes of every tensor of ``spec`` as written (the folder, or a GGUF: the same)."""
    return sum(n for plan in tensor_plans(spec) for *_, n in stored_layout(plan))


__all__ = [
    "DEFAULT_FORMAT",
    "LOGIT_STD",
    "PREFIX",
    "SHAPES",
    "VOCAB_SIZE",
    "SynthFormat",
    "SynthShape",
    "SynthSpec",
    "TensorPlan",
    "compact_pieces",
    "draw",
    "gguf_blocks",
    "is_synth_name",
    "matrix_kind",
    "parse_synth_name",
    "row_chunks",
    "stored_bytes",
    "stored_layout",
    "synth_config",
    "tensor_plans",
]
