"""A grammar-constrained session (JSON-schema output) that loses its last stage
mid-answer resumes on the replica: the gateway names the tokens drawn so far
(``OpenSession.drawn``), the new last stage's grammar takes them, and the
answer equals one process's under the same grammar, token for token.

Real stages of the default model and a real gateway (``tiny_hops``); the last
stage ``b`` freezes mid-answer and is declared dead, ``b2`` is its replica.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from hetmesh.node.gateway import Hop
from hetmesh.partition.generate import LocalPipeline
from hetmesh.partition.grammar import Grammars, json_schema_grammar
from hetmesh.partition.sampling import SamplingParams
from hetmesh.partition.text import load_tokenizer
from tests.integration.node.mesh_nodes import encode
from tests.integration.node.tiny_hops import Hops

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NEW_TOKENS = 40
FREEZE_AFTER = 5  # inside the object: the grammar's state is not its start


async def test_a_constrained_answer_resumes_on_a_replica_with_identical_tokens(
    default_model_dir: Path,
) -> None:
    prompt = encode(default_model_dir, "Describe a person as JSON.", chat=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, grammar=json_schema_grammar(PERSON))
    local = LocalPipeline.load(default_model_dir, 1)
    expected = [int(t) for t in local.generate_ids(prompt, params, eos_ids=set())]
    assert len(expected) > FREEZE_AFTER  # the freeze falls mid-answer

    grammars = Grammars(lambda: load_tokenizer(default_model_dir))
    primary = (Hop("a", 0, 16), Hop("b", 16, 32))
    replica = (Hop("a", 0, 16), Hop("b2", 16, 32))
    hops = Hops(
        default_model_dir,
        {"a": (0, 16), "b": (16, 32), "b2": (16, 32)},
        [primary, replica],
        grammars=grammars,
        max_tokens=256,
    )
    out: list[int] = []
    async with trio.open_nursery() as nursery:
        await hops.serve(nursery)
        with trio.fail_after(300):
            async with aclosing(hops.gateway.generate(prompt, params)) as tokens:
                async for token in tokens:
                    out.append(token)
                    if len(out) == FREEZE_AFTER:
                        hops.frozen.add("b")  # its next step never comes back
                        hops.gateway.peer_gone("b")
        nursery.cancel_scope.cancel()
    assert out == expected
    assert hops.gateway.statistics().recoveries == 1
    assert hops.servers["b2"].statistics().items >= 1  # the replica drew the rest
    text = local.tokenizer.decode(out, skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "age"}
