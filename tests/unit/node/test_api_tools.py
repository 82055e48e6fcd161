"""Tools, tool_choice and tool messages: parsing, rendering, grammar, calls (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hetmesh.errors import InvalidRequest
from hetmesh.node.api_requests import ApiError, parse_api_request
from hetmesh.node.api_tools import (
    TOOLS_PROMPT,
    HeldCall,
    call_deltas,
    call_lark,
    parse_call,
    parse_tools,
    render_messages,
)
from hetmesh.partition.grammar import lark_grammar

FN = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
OTHER = {"type": "function", "function": {"name": "noop"}}


def test_tool_choice_forms() -> None:
    assert parse_tools(None, None) is None
    assert parse_tools([FN], None).choice == "auto"  # type: ignore[union-attr]
    named = parse_tools([FN, OTHER], {"type": "function", "function": {"name": "noop"}})
    assert named is not None
    assert named.choice == "noop"
    assert not parse_tools([FN], "none").active  # type: ignore[union-attr]
    for tools, choice, param in [
        (None, "required", "tool_choice"),
        ([FN], "sometimes", "tool_choice"),
        ([FN], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        ([FN, FN], None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        ([], None, "tools"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            parse_tools(tools, choice)
        assert refused.value.param == param


def test_messages_render_calls_results_and_the_tools_prompt() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "tools": [FN],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1+2?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
    }
    parsed = parse_api_request(body, chat=True, models=["m"])
    messages = parsed.request.messages
    assert messages is not None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[0]["content"].startswith("Be brief.\n\n" + TOOLS_PROMPT)
    assert json.loads(messages[0]["content"].split("\n")[-1])[0]["name"] == "add"
    assert messages[2]["content"] == '{"name":"add","arguments":{"a":1}}'
    assert messages[3]["content"] == "3"
    # tool_choice none: no tools prompt
    plain = render_messages([{"role": "user", "content": "hi"}], parse_tools([FN], "none"))
    assert plain == [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError) as refused:
        parse_api_request(
            body | {"response_format": {"type": "json_object"}}, chat=True, models=["m"]
        )
    assert refused.value.param == "response_format"


def test_the_grammars_compile_and_calls_parse() -> None:
    for choice in ("auto", "required", "add"):
        named = {"type": "function", "function": {"name": "add"}}
        tools = parse_tools([FN, OTHER], named if choice == "add" else choice)
        assert tools is not None
        lark = call_lark(tools)
        assert lark is not None
        assert ("TEXT" in lark) == (choice == "auto")
        assert ('"noop"' in lark) == (choice != "add")  # a named function: only its calls
        assert lark_grammar(lark)  # the engine compiles it (InvalidRequest otherwise)
    assert call_lark(parse_tools([FN], "none")) is None  # type: ignore[arg-type]
    tools = parse_tools([FN], None)
    calls = parse_call('{"name":"add","arguments":{"a":2}}', tools)
    assert calls is not None
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a":2}'}
    assert parse_call("The answer is 3.", tools) is None
    assert parse_call('{"name":"add","argu', tools) is None  # cut short


def _arguments(deltas: list[dict[str, Any]]) -> list[str]:
    return [
        d["tool_calls"][0]["function"]["arguments"]
        for d in deltas
        if "id" not in d["tool_calls"][0]
    ]


def test_a_streamed_call_sends_its_name_then_its_arguments_token_by_token() -> None:
    tools = parse_tools([FN, OTHER], None)
    assert tools is not None
    held = HeldCall(tools)
    tokens = ['{"', 'name":"a', 'dd","', 'arguments":{"', "a", '":', "5", "}", "}"]
    sent: list[list[dict[str, Any]]] = []
    for token in tokens:
        assert held.feed(token) == ""  # a call streams no content
        sent.append(held.deltas())
    assert sent[:3] == [[], [], []]  # the name and "arguments": not written yet
    head = sent[3][0]  # the head the moment "arguments": is written
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert head["tool_calls"][0]["id"].startswith("call_")
    assert head["tool_calls"][0]["type"] == "function"
    pieces = [_arguments(d) for d in sent]
    assert pieces[3:] == [['{"'], ["a"], ['":'], ["5"], [], ["}"]]  # a "}" waits a token
    calls, rest, tail = held.finish()
    assert calls is not None
    assert calls[0]["function"]["name"] == "add"
    assert rest == ""
    assert tail == []  # the last "}" closed the call: not an argument
    assert "".join(p for ps in pieces for p in ps) == '{"a":5}'
    # the deltas of a call made whole (not streamed) are the same shape
    deltas = call_deltas(calls)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"a":5}'


def test_a_streamed_call_cut_short_sends_what_it_wrote() -> None:
    tools = parse_tools([FN], None)
    assert tools is not None
    cut = HeldCall(tools)
    for token in ('{"name":"add","arguments":', '{"a":{"b":1}'):
        cut.feed(token)
        cut.deltas()
    calls, rest, tail = cut.finish()  # max_tokens: no call, the held "}" was an argument's
    assert calls is None
    assert rest == ""
    assert _arguments(tail) == ["}"]


def test_a_streamed_call_is_held_and_text_passes() -> None:
    tools = parse_tools([FN], None)
    assert tools is not None
    text = HeldCall(tools)
    assert [text.feed(t) for t in (" ", "Three", ".")] == ["", " Three", "."]
    assert text.deltas() == []
    assert text.finish() == (None, "", [])
    cut = HeldCall(tools)
    cut.feed('{"name":"ad')
    assert cut.deltas() == []
    assert cut.finish() == (None, '{"name":"ad', [])  # cut before its name: text
