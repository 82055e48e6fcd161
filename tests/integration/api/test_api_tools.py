"""Tool calls through the real `openai` client against the shared three-node mesh.

The default model's template has no tool format: the fallback system prompt
lists the functions (hetmesh.node.api_tools) and the last stage holds the
model to a call whose arguments follow the function's schema.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.integration.api.api_mesh import Mesh

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
            },
        },
    },
]
ASK = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture
def mesh(shared_mesh3: Mesh) -> Mesh:
    return shared_mesh3


def _client(mesh: Mesh) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{mesh.api_url}/v1", api_key="unused", max_retries=0)


def test_the_openai_clients_two_step_tool_loop(mesh: Mesh) -> None:
    client = _client(mesh)
    messages: list[Any] = [ASK]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=48
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    schema = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    messages.append(choice.message)  # the assistant's call, as the client hands it back
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"})
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=32
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert not answer.message.content.lstrip().startswith("{")


def test_streamed_tool_calls_and_auto(mesh: Mesh) -> None:
    client = _client(mesh)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[ASK],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        stream=True,
    )
    names, ids, pieces, reasons = [], [], [], []
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id:
                    assert not pieces  # the id and name come first
                    ids.append(delta.id)
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                if delta.function and delta.function.arguments:
                    pieces.append(delta.function.arguments)
            assert not c.delta.content  # a call streams no content
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert names == ["get_weather"]
    assert len(ids) == 1
    assert reasons == ["tool_calls"]
    # the arguments stream token by token, as OpenAI's do: several deltas, whole JSON
    assert len(pieces) >= 4, pieces
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)

    # auto: the model chooses; whichever it chose is well formed
    reply = client.chat.completions.create(
        model=MODEL, messages=[ASK], tools=TOOLS, max_tokens=48
    ).choices[0]
    if reply.message.tool_calls:
        assert reply.finish_reason == "tool_calls"
        assert reply.message.tool_calls[0].function.name in ("get_weather", "get_time")
        json.loads(reply.message.tool_calls[0].function.arguments)
    else:
        assert not (reply.message.content or "").lstrip().startswith("{")
