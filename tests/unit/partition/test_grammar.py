"""A session's grammar (hetmesh.partition.grammar): the mask it computes ahead on a
worker, and the token it takes there, keep draws inside the schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetmesh.errors import InvalidRequest
from hetmesh.partition.grammar import Grammars, json_schema_grammar

pytestmark = pytest.mark.model

SCHEMA = {  # bounded: random logits reach its end
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 3},
            "maxItems": 2,
        },
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars(default_model_dir: Path) -> Grammars:
    from hetmesh.partition.text import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    return Grammars(lambda: tokenizer)


def test_draws_under_random_logits_stay_inside_the_schema(grammars: Grammars) -> None:
    import llguidance

    hf = grammars.tokenizer()
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        constraint = grammars.constraint(json_schema_grammar(SCHEMA))
        drawn: list[int] = []
        for step in range(64):
            scores = torch.randn(49152, generator=generator)
            masked = constraint.apply(scores, step)
            token = int(masked.argmax())
            assert torch.isfinite(masked[token])
            if token == hf.eos_token:
                break
            constraint.advance(token)  # taken on the worker, with the next mask
            drawn.append(token)
        else:
            pytest.fail("the grammar never allowed only the end")
        value = json.loads(hf.decode_str(drawn))
        assert set(value) == {"n", "tags"}
        assert isinstance(value["n"], int)
        assert all(isinstance(t, str) for t in value["tags"])
    # the unpacked mask is llguidance's bitmask, bit for bit
    matcher = llguidance.LLMatcher(hf, json_schema_grammar(SCHEMA))
    bitmask = llguidance.torch.allocate_token_bitmask(1, hf.vocab_size)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    words = bitmask[0].numpy().astype(np.int64)
    expected = [(words[i // 32] >> (i % 32)) & 1 == 1 for i in range(hf.vocab_size)]
    ours = grammars.constraint(json_schema_grammar(SCHEMA)).apply(torch.zeros(hf.vocab_size), 0)
    assert (ours == 0).tolist() == expected


def test_a_token_outside_the_grammar_fails_the_next_draw(grammars: Grammars) -> None:
    hf = grammars.tokenizer()
    constraint = grammars.constraint(json_schema_grammar(SCHEMA))
    constraint.apply(torch.zeros(hf.vocab_size), 0)
    constraint.advance(hf.tokenize_str("hello")[0])  # not JSON: refused on the worker
    with pytest.raises(InvalidRequest, match="refused token"):
        constraint.apply(torch.zeros(hf.vocab_size), 1)
