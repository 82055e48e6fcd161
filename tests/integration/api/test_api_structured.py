"""response_format through the real `openai` client against the shared three-node mesh.

The grammar is enforced on the last stage (another process, reached over TCP):
every output parses and validates against its schema, and greedy output under
a schema equals the single-process pipeline's under the same grammar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hetmesh.partition.grammar import json_schema_grammar
from hetmesh.protocol.generate import SamplingParams
from tests.integration.api.api_mesh import WEIGHTS, Mesh

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture
def mesh(shared_mesh3: Mesh) -> Mesh:
    return shared_mesh3


def _client(mesh: Mesh) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{mesh.api_url}/v1", api_key="unused", max_retries=0)


def test_greedy_output_under_a_schema_equals_one_process(
    mesh: Mesh, default_model_dir: Path
) -> None:
    from hetmesh.partition.generate import LocalPipeline
    from tests.integration.node.mesh_nodes import encode

    ids = encode(default_model_dir, ASK[0]["content"], chat=True)
    local = LocalPipeline.load(default_model_dir, 1, weights=WEIGHTS)
    params = SamplingParams(max_new_tokens=48, grammar=json_schema_grammar(PERSON))
    expected = [int(t) for t in local.generate_ids(ids, params)]

    reply = _client(mesh).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, response_format=FORMAT
    )
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == expected
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"


def test_json_schema_output_is_valid_100_of_100_times(mesh: Mesh) -> None:
    client = _client(mesh)
    outputs: list[str] = []
    for seed in range(25):  # 25 requests of 4 sampled choices each
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=64,
            response_format=FORMAT,
            temperature=1.0,
            seed=seed,
            n=4,
        )
        outputs += [c.message.content or "" for c in reply.choices]
    assert len(outputs) == 100
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(outputs)) > 10  # sampled: the schema does not force one answer


def test_a_streamed_schema_and_json_object(mesh: Mesh) -> None:
    client = _client(mesh)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64, response_format=FORMAT, stream=True
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # any JSON object: the model ends it (greedy, within the budget) and it parses
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the colour of the sky as JSON."}],
        max_tokens=96,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
