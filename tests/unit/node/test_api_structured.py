"""response_format: the grammar a schema becomes, and the API's handling of it (fake mesh).

The grammar's effect on real sampling is tested on the default model
(test_greedy_output_under_a_schema_is_valid_json, slow) and on the real mesh
in tests/integration/api/test_api_structured.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from hetmesh.errors import InvalidRequest
from hetmesh.partition.grammar import json_schema_grammar
from hetmesh.protocol.generate import SamplingParams
from tests.unit.node.test_api import MODEL
from tests.unit.node.test_api_logprobs import LogprobsBackend

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_schema_becomes_grammar_text_and_a_bad_one_is_refused() -> None:
    grammar = json_schema_grammar(PERSON)
    assert json.loads(grammar)["grammars"][0]["json_schema"]["required"] == ["name", "age"]
    assert SamplingParams(grammar=grammar).to_wire()["grammar"] == grammar
    with pytest.raises(InvalidRequest) as refused:
        json_schema_grammar({"type": "no-such-type"})
    assert refused.value.param == "response_format"
    with pytest.raises(InvalidRequest):
        SamplingParams(grammar="x" * (33 * 1024))


@pytest.mark.slow
def test_greedy_output_under_a_schema_is_valid_json(default_model_dir: Path) -> None:
    import torch

    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.text import encode_prompt

    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(default_model_dir, 1, weights="float32")
    ids = encode_prompt(pipeline.tokenizer, "Describe a person.", chat=True)
    grammar = json_schema_grammar(PERSON)
    for params in (
        SamplingParams(max_new_tokens=48, grammar=grammar),
        SamplingParams(max_new_tokens=48, grammar=grammar, temperature=1.0, seed=7),
    ):
        text = "".join(pipeline.generate_text(ids, params))
        jsonschema.validate(json.loads(text), PERSON)
    free = "".join(pipeline.generate_text(ids, SamplingParams(max_new_tokens=8)))
    with pytest.raises(json.JSONDecodeError):  # without the schema the model writes prose
        json.loads(free)


async def test_response_format_reaches_the_stage_as_a_grammar(
    api: tuple[httpx.AsyncClient, LogprobsBackend],
) -> None:
    http, backend = api
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    assert (
        await http.post("/v1/chat/completions", json=base | {"response_format": fmt})
    ).is_success
    assert json.loads(backend.asked[-1].grammar)["grammars"][0]["json_schema"]["required"] == [
        "name",
        "age",
    ]
    any_object = {"response_format": {"type": "json_object"}}
    assert (await http.post("/v1/chat/completions", json=base | any_object)).is_success
    assert '"type":"object"' in backend.asked[-1].grammar.replace(" ", "")
    text = {"response_format": {"type": "text"}}
    assert (await http.post("/v1/chat/completions", json=base | text)).is_success
    assert backend.asked[-1].grammar == ""


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "xml"},
        "json",
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    ],
)
async def test_a_bad_response_format_is_a_400_naming_it(
    api: tuple[httpx.AsyncClient, LogprobsBackend], fmt: object
) -> None:
    http, backend = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
    reply = await http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "response_format"
    assert backend.asked == []
    # completions have no response_format: refused by name as well
    body = {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"}}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "response_format"
