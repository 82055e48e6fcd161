"""logprobs and n > 1 through the real `openai` client, against the shared three-node mesh.

The log-probabilities come from the last stage, over TCP in the Tokens frame,
and equal the single-process reference's; n greedy choices are equal, n seeded
ones are reproducible, and the choices after the first find the prompt's KV in
the prefix cache.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from hetmesh.protocol.generate import SamplingParams
from hetmesh.protocol.logprobs import logprobs_of
from tests.integration.api.api_mesh import WEIGHTS, Mesh

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The three primary colours are"
TOKENS = 6


@pytest.fixture
def mesh(shared_mesh3: Mesh) -> Mesh:
    return shared_mesh3


def _client(mesh: Mesh):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{mesh.api_url}/v1", api_key="unused", max_retries=0)


def test_logprobs_equal_the_single_process_reference(mesh: Mesh, default_model_dir: Path) -> None:
    from hetmesh.partition.generate import LocalPipeline
    from tests.integration.node.mesh_nodes import encode

    ids = encode(default_model_dir, PROMPT)
    local = LocalPipeline.load(default_model_dir, 1, weights=WEIGHTS)
    expected = []
    for token in local.generate_ids(ids, SamplingParams(max_new_tokens=TOKENS, logprobs=2)):
        info = logprobs_of(token)
        assert info is not None
        expected.append((int(token), info))

    client = _client(mesh)
    completion = client.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=TOKENS, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.model_extra["token_ids"] == [t for t, _ in expected]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(
        [info.logprob for _, info in expected], abs=1e-3
    )
    assert [len(top) for top in choice.logprobs.top_logprobs or []] == [2] * TOKENS
    assert "".join(choice.logprobs.tokens or []) == choice.text

    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=TOKENS,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    entries = []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                entries += c.logprobs.content
    assert len(entries) == TOKENS
    for entry in entries:  # greedy: the drawn token is the likeliest
        assert entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def _skipped(mesh: Mesh) -> float:
    """Prompt tokens the API node's gateway found cached on every stage (not prefilled)."""
    text = httpx.get(f"{mesh.api_url}/metrics", timeout=10).text
    found = re.search(r"^hetmesh_gateway_prefix_tokens_skipped_total (\S+)$", text, re.M)
    assert found is not None, text[:2000]
    return float(found.group(1))


def test_n_choices_share_the_prompt_and_are_deterministic(mesh: Mesh) -> None:
    client = _client(mesh)
    # a prompt of several full KV blocks (16 tokens each) that no other test sends
    prompt = "A list of the rivers of Europe, from the longest: the Volga, " * 3
    before = _skipped(mesh)
    greedy = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=TOKENS, n=3
    )
    texts = [c.text for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert texts[0]
    assert texts == [texts[0]] * 3
    assert greedy.usage is not None
    assert greedy.usage.completion_tokens == 3 * len(greedy.choices[0].model_extra["token_ids"])
    # the two later choices each found the prompt's full blocks (16 tokens each) cached
    assert _skipped(mesh) - before >= 2 * 16

    def sampled() -> list[list[int]]:
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=TOKENS,
            n=2,
            temperature=1.0,
            seed=11,
        )
        return [c.model_extra["token_ids"] for c in reply.choices]

    first = sampled()
    assert first == sampled()
    assert first[0] != first[1]  # two seeds, two draws
