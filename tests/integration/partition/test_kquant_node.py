"""A Q4_K_M GGUF served by ``hetmesh node start --model file.gguf``: two node processes
split it, hold it compact (int4, its Q6_K matrices int8) and return the greedy tokens of
one process holding the whole model the same way."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from tests.integration.node.mesh_nodes import (
    SERVE_ARGS,
    NodeFactory,
    generate_ids,
    reference_ids,
    view_of,
    wait_serving,
)
from tests.unit.partition.kquant_files import more_bits

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAYERS = 4
NEW_TOKENS = 12
# the planner charges the model ~0.06 GiB (int4/int8 weights, KV budget, workspace);
# a node offers this cap less its 64 MiB reserve (46 MiB): one cannot hold it, two can
NODE_MEMORY = "110MiB"


def _write_q4_k_m(path: Path) -> None:
    """A seeded Llama, wide enough that its weights outweigh its KV, as a Q4_K_M GGUF."""
    import torch
    import transformers

    from tests.unit.partition.kquant_files import byte_tokens, write_model_gguf

    config = transformers.LlamaConfig(
        vocab_size=len(byte_tokens()[0]),
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=LAYERS,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.05)
    write_model_gguf(model, path)


def test_q4_k_m_gguf_is_split_held_compact_and_matches_one_process(tmp_path: Path) -> None:
    import trio

    from hetmesh.cli.status_view import summarize
    from hetmesh.partition.store import resolve_model

    gguf_path = tmp_path / "tiny-q4_k_m.gguf"
    _write_q4_k_m(gguf_path)
    cache = tmp_path / "cache"
    folder = resolve_model(gguf_path, cache_dir=cache)  # what each node resolves it to
    args = [
        *("--model", str(gguf_path), "--cache-dir", str(cache)),
        *SERVE_ARGS,
        *("--max-memory", NODE_MEMORY, "--max-context", "512", "--block-step-ms", "2"),
    ]
    factory = NodeFactory(tmp_path / "nodes")
    try:
        first = factory.start(*args).wait_ready(120)
        second = factory.start(*args, "--bootstrap", first.addr).wait_ready(120)
        wait_serving(first, timeout_s=240)
        view = trio.run(view_of, first)
        (pipeline,) = summarize(view)["plan"]["pipelines"]
        stages = pipeline["stages"]
        assert len(stages) == 2, stages  # neither node holds it alone
        assert {s["weights"] for s in stages} == {"int4"}  # native: the file's 4-bit part
        prompt = list(range(10, 40))
        for node in (first, second):
            got = trio.run(partial(generate_ids, node.addr, prompt, max_new_tokens=NEW_TOKENS))
            assert got == reference_ids(folder, prompt, NEW_TOKENS), node.log()[-2000:]
    finally:
        factory.close()

    # the single-process twin holds the file's blocks: int4 groups; a Q6_K matrix in int8
    # where the conversion's budget kept it so (its record), else refitted to int4
    from hetmesh.partition.kquant import KQuantEmbedding
    from hetmesh.partition.quant import Int4Linear, Int8Linear
    from hetmesh.partition.stage import load_stage

    whole = load_stage(folder, 0, LAYERS + 2, weights="native")
    assert isinstance(whole.embed_tokens, KQuantEmbedding)
    assert any(more_bits(index, LAYERS) for index in range(LAYERS))
    kept = json.loads((folder / "config.json").read_text()).get("hetmesh_int8_linears", {})
    for index, layer in enumerate(whole.layers):
        int8 = "mlp.down_proj" in kept.get(str(index), [])
        assert not int8 or more_bits(index, LAYERS)
        assert isinstance(layer.mlp.down_proj, Int8Linear if int8 else Int4Linear)
        assert isinstance(layer.mlp.gate_proj, Int4Linear)
    assert whole.resident_bytes() < 1.1 * gguf_path.stat().st_size
