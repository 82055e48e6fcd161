"""The scripted int4 decode step (hetmesh.partition.lean_script) gives the stage's bits."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.jit._fuser import optimized_execution

from hetmesh.partition import exact_gemm
from hetmesh.partition import stage as stage_module
from hetmesh.partition.exact_gemm import WIDE_ROWS, per_query_calls
from hetmesh.partition.lean import gemm_sizes, gemm_step
from hetmesh.partition.lean_script import SCRIPT_ENV, _attend, script_default
from hetmesh.partition.stage import StageModule, load_stage
from tests.unit.partition.tiny_models import VOCAB, count_calls


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def wide_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose int4 products are all whole blocks of 64 rows (no padding)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 320,
        "tie_word_embeddings": False,
    }
    if request.param == "llama":
        config = transformers.LlamaConfig(**common)
    else:  # a window shorter than the prompt: each layer's own first key
        config = transformers.MistralConfig(**common, sliding_window=9)
    torch.manual_seed(3)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp(f"script-{request.param}")
    model.save_pretrained(str(folder))
    return folder


def _decode(stage: StageModule, prompt: torch.Tensor, steps: int, **switches: bool) -> list[Any]:
    for name, value in switches.items():
        setattr(stage, name, value)
    kv = stage.new_kv()
    outputs = [stage.forward(prompt, kv)]
    for _ in range(steps):
        token = int(outputs[-1][-1].argmax())
        outputs.append(stage.forward(torch.tensor([token]), kv))
    return outputs


def _script_attend() -> Any:
    """lean_script's attention compiled as the script compiles it (torch.jit's deprecation
    warning silenced, as lean_script silences it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_attend)


def _count_scripted_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each scripted decode step."""
    return count_calls(monkeypatch, stage_module, "decode_layers")


def test_scripted_decode_steps_bit_identical(
    monkeypatch: pytest.MonkeyPatch, wide_dir: Path
) -> None:
    stage = load_stage(wide_dir, 0, 5, weights="int4")
    assert stage.lean
    assert stage.lean_script
    calls = _count_scripted_steps(monkeypatch)
    prompt = torch.randint(4, VOCAB, (13,), generator=torch.Generator().manual_seed(1))
    # the script's attention is one sdpa call: it runs where exact attention's is too
    with per_query_calls():
        eager = _decode(stage, prompt, 10, lean=False)
        unscripted = _decode(stage, prompt, 10, lean=True, lean_script=False)
        assert not calls
        scripted = _decode(stage, prompt, 10, lean=True, lean_script=True)
    assert len(calls) == 10  # one call a decode step, every layer inside it
    for a, b, c in zip(scripted, unscripted, eager, strict=True):
        assert torch.equal(a, c)
        assert torch.equal(b, c)


@pytest.mark.parametrize("rows", [None, WIDE_ROWS])
@pytest.mark.parametrize("prompt_length", [13, 250])
def test_where_exact_attention_takes_products_the_script_takes_them_too(
    monkeypatch: pytest.MonkeyPatch, wide_dir: Path, prompt_length: int, rows: int | None
) -> None:
    """Exact attention in products (hetmesh.partition.exact_gemm) rounds otherwise than one
    sdpa call: the scripted step then computes attention the products' way, so its bits
    are those of lean_decode, lean layers and transformers' layers. 13 tokens: the first
    steps' keys are padded to 16; 250: the steps cross the key block at 256 (a block of
    one key, padded). ``rows``: the probe's verdict for the shape forced to WIDE_ROWS
    rows a product (as for Llama 3.x 8B's heads: a step's two query heads a key head
    padded with zero rows), else the probe's own."""
    stage = load_stage(wide_dir, 0, 5, weights="int4")
    products = stage._gemm()  # whether this shape's exact attention does, on this CPU
    if not products:
        pytest.skip("exact attention makes one call per query for this shape on this CPU")
    if rows is not None:
        monkeypatch.setitem(exact_gemm._VERDICTS, (4, 2, 32), rows)
        assert stage._gemm_rows() == rows
    calls = _count_scripted_steps(monkeypatch)
    prompt = torch.randint(4, VOCAB, (prompt_length,), generator=torch.Generator().manual_seed(2))
    eager = _decode(stage, prompt, 10, lean=False)
    lean = _decode(stage, prompt, 10, lean=True, lean_decode=False)
    unscripted = _decode(stage, prompt, 10, lean=True, lean_decode=True, lean_script=False)
    assert not calls
    scripted = _decode(stage, prompt, 10, lean=True, lean_script=True)
    assert len(calls) == 10  # one call a decode step, every layer inside it
    for a, b, c, d in zip(scripted, unscripted, lean, eager, strict=True):
        assert torch.equal(a, d)
        assert torch.equal(b, d)
        assert torch.equal(c, d)


def test_scripted_middle_stage_bit_identical(wide_dir: Path) -> None:
    stage = load_stage(wide_dir, 1, 3, weights="int4")  # two layers, hidden states in and out
    hidden = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    outs = []
    with per_query_calls():
        for lean, script in ((False, False), (True, True)):
            stage.lean, stage.lean_script = lean, script
            kv = stage.new_kv()
            outs.append([stage.forward(hidden, kv)] + [stage.forward(h[None], kv) for h in hidden])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_script_switch_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, wide_dir: Path
) -> None:
    monkeypatch.setenv(SCRIPT_ENV, "0")
    assert not script_default()
    assert not load_stage(wide_dir, 0, 2, weights="int4").lean_script
    monkeypatch.delenv(SCRIPT_ENV)
    assert script_default()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "rows"), [(9, 3, 2), (4, 2, 2), (8, 2, 4), (6, 6, 1)]
)
@pytest.mark.parametrize("keys", [16, 17, 46, 256, 257, 271, 300, 513])
def test_unmasked_attention_is_gemm_steps(heads: int, kv_heads: int, rows: int, keys: int) -> None:
    """The script's attention where no key is masked and no query row padded (a session's
    every key from its first slot; as many query heads a key head as a product's rows at
    least) is gemm_step's, bit for bit: one key block, several, a last block of fewer
    than MIN_KEYS keys (padded) and of more."""
    dim, first, slots = 64, 5, 600
    gen = torch.Generator().manual_seed(keys * 31 + heads)
    pool_keys = torch.randn(kv_heads, slots, dim, generator=gen).to(torch.float16)
    pool_values = torch.randn(kv_heads, slots, dim, generator=gen).to(torch.float16)
    q = torch.randn(1, 1, heads, dim, generator=gen)
    scale = dim**-0.5
    sizes = gemm_sizes(rows)
    end = first + keys
    want = gemm_step(
        q.reshape(1, 1, -1, dim).transpose(1, 2),
        pool_keys[None, :, first:end].to(torch.float32),
        pool_values[None, :, first:end].to(torch.float32),
        0,
        keys,
        scale,
        sizes,
    )
    scale_t = torch.tensor(scale, dtype=torch.float32)
    with optimized_execution(False):  # as decode_layers runs it
        got = _script_attend()(q, pool_keys, pool_values, first, end, scale_t, dim, sizes)
    assert torch.equal(got.reshape(-1), want.reshape(-1))
