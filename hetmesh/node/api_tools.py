"""Tool calls for the chat API: ``tools``, ``tool_choice``, ``tool`` messages (pure).

The default model's chat template (SmolLM2's) has no tool format, so tools are
rendered through a documented fallback: a system message (:data:`TOOLS_PROMPT`)
listing the functions and asking for a call as one JSON object
``{"name": ..., "arguments": {...}}``; an earlier assistant call is rendered
as that object, and a ``tool`` message as a ``tool`` turn of the template.

What the model may write is a grammar (:func:`call_grammar`, enforced on the
last stage like ``response_format``): ``auto`` is free text that does not start
with ``{``, or one call; ``required`` one call; a named function a call of
that function; every call's ``arguments`` valid against its function's JSON
schema. ``none`` adds no grammar and lists no tools. :func:`parse_call` turns
the output back into OpenAI's ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetmesh.errors import InvalidRequest

TOOLS_PROMPT = (
    "You can call the functions listed below. To call one, answer with only a JSON "
    'object {"name": <function name>, "arguments": <object of its arguments>} and '
    "nothing else; otherwise answer in plain text. Functions (JSON schema of each "
    "one's arguments):\n"
)
MAX_TOOLS = 64


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's functions and its ``tool_choice``: "auto", "none", "required" or
    a function's name."""

    tools: tuple[Tool, ...]
    choice: str = "auto"

    @property
    def active(self) -> bool:
        """Whether the model is offered the tools (not ``tool_choice: none``)."""
        return bool(self.tools) and self.choice != "none"


def _refuse(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def parse_tools(tools: Any, choice: Any) -> Tools | None:
    """The ``tools`` and ``tool_choice`` of a chat body, checked; ``InvalidRequest``."""
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _refuse("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise _refuse(f"tools must be a list of 1 to {MAX_TOOLS} functions", "tools")
    out: list[Tool] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise _refuse("each tool must be {type: function, function: {name, ...}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name or name in {t.name for t in out}:
            raise _refuse(f"each function needs a distinct name, got {name!r}", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        description = function.get("description", "")
        if not isinstance(parameters, dict) or not isinstance(description, str):
            raise _refuse(f"function {name}: parameters must be an object", "tools")
        out.append(Tool(name, description, parameters))
    names = {t.name for t in out}
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        choice = function.get("name") if isinstance(function, dict) else None
        if choice not in names:
            raise _refuse(f"tool_choice names no function of tools: {choice!r}", "tool_choice")
    elif choice not in ("auto", "none", "required"):
        raise _refuse("tool_choice must be auto, none, required or a function", "tool_choice")
    return Tools(tuple(out), str(choice))


def render_messages(raw: Sequence[Mapping[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """The conversation as the template's plain turns: assistant calls as their JSON,
    ``tool`` results as ``tool`` turns, the tools' system message first."""
    out: list[dict[str, str]] = []
    for m in raw:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise _refuse("tool_calls must be a list", "messages")
            out.append({"role": "assistant", "content": "\n".join(_call_text(c) for c in calls)})
        else:
            out.append({"role": str(m["role"]), "content": str(m["content"])})
    if tools is not None and tools.active:
        listing = json.dumps(
            [
                {"name": t.name, "description": t.description, "parameters": t.parameters}
                for t in _offered(tools)
            ]
        )
        if out and out[0]["role"] == "system":
            out[0] = {
                "role": "system",
                "content": f"{out[0]['content']}\n\n{TOOLS_PROMPT}{listing}",
            }
        else:
            out.insert(0, {"role": "system", "content": TOOLS_PROMPT + listing})
    return out


def _call_text(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _refuse("each tool call needs a function with a name", "messages")
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as exc:
        raise _refuse(f"a tool call's arguments are not JSON: {exc}", "messages") from exc
    return json.dumps({"name": function["name"], "arguments": parsed}, separators=(",", ":"))


def _offered(tools: Tools) -> tuple[Tool, ...]:
    """The functions the model may call: every one, or the one ``tool_choice`` names."""
    if tools.choice in ("auto", "required", "none"):
        return tools.tools
    return tuple(t for t in tools.tools if t.name == tools.choice)


def call_schema(tools: Tools) -> dict[str, Any]:
    """The JSON schema of one call of an offered function (compact output)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in _offered(tools)
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return schema | {"x-guidance": {"whitespace_flexible": False}}


def call_lark(tools: Tools) -> str | None:
    """The Lark grammar text of what the model may write (None: free text)."""
    if not tools.active:
        return None
    call = "call: %json " + json.dumps(call_schema(tools))
    if tools.choice == "auto":  # free text (not starting with "{"), or one call
        return "start: call | TEXT\n" + call + "\nTEXT: /[^{\\s][\\s\\S]*/\n"
    return "start: call\n" + call + "\n"


def parse_call(text: str, tools: Tools | None) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` for an output that is a call, else None."""
    if tools is None or not tools.active or not text.lstrip().startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None  # cut short by max_tokens: left as text
    if not isinstance(call, dict) or call.get("name") not in {t.name for t in tools.tools}:
        return None
    arguments = json.dumps(call.get("arguments", {}), separators=(",", ":"))
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }
    ]


# the start of a call as the grammar makes the model write it (compact JSON, the
# properties in the schema's order): its function's name, then its arguments
_HEAD = re.compile(r'\s*\{"name":"([^"\\]+)","arguments":')


class HeldCall:
    """One streamed choice under active tools: output that starts with ``{`` is a call,
    other text passes through. A call streams as OpenAI's do: its id and name once the
    model has written the name, then its arguments as the tokens come
    (:meth:`deltas`), the character that may close the call held back."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.held: list[str] = []
        self.calling: bool | None = None  # None: not known until a visible character
        self.head: dict[str, Any] | None = None  # the call's id and name, once sent
        self._arguments_at = 0  # where the arguments start in the held text
        self._sent = 0  # characters of the arguments sent

    def feed(self, text: str) -> str:
        """The text to stream now ("" while it is held)."""
        if self.calling is False:
            return text
        self.held.append(text)
        joined = "".join(self.held)
        if self.calling is None and joined.strip():
            self.calling = joined.lstrip().startswith("{")
            if not self.calling:
                self.held = []
                return joined
        return ""

    def _arguments(self) -> str:
        return "".join(self.held)[self._arguments_at :]

    def deltas(self) -> list[dict[str, Any]]:
        """The ``tool_calls`` deltas the call can send now: its head (id, name) once the
        name is written, then the arguments written since the last call of this (a
        trailing ``}``, which may close the call rather than the arguments, waits)."""
        if not self.calling:
            return []
        out: list[dict[str, Any]] = []
        if self.head is None:
            found = _HEAD.match("".join(self.held))
            if found is None or found.group(1) not in {t.name for t in self.tools.tools}:
                return []  # not yet written (or not in this order: sent whole at the end)
            self.head = {"id": "call_" + uuid.uuid4().hex[:24], "name": found.group(1)}
            self._arguments_at = found.end()
            out.append(_head_delta(self.head))
        body = self._arguments().rstrip()
        ready = body[:-1] if body.endswith("}") else body
        if len(ready) > self._sent:
            out.append(_arguments_delta(ready[self._sent :]))
            self._sent = len(ready)
        return out

    def finish(self) -> tuple[list[dict[str, Any]] | None, str, list[dict[str, Any]]]:
        """The call (None: none), the held text still to stream as text (a call cut
        short before its name), and the ``tool_calls`` deltas still to send."""
        joined = "".join(self.held)
        calls = parse_call(joined, self.tools) if self.calling else None
        if self.head is None:
            return calls, "" if calls else joined, call_deltas(calls or [])
        body = self._arguments().rstrip()
        if calls is not None:  # whole: the last "}" closed the call
            body = body[:-1]
        rest = [_arguments_delta(body[self._sent :])] if len(body) > self._sent else []
        self._sent = len(body)
        return calls, "", rest


def _head_delta(head: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    function = {"name": head["name"], "arguments": ""}
    return {
        "tool_calls": [{"index": index, "id": head["id"], "type": "function", "function": function}]
    }


def _arguments_delta(text: str, index: int = 0) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def call_deltas(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The streamed deltas of ``calls``: each call's id and name, then its arguments."""
    out: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        function = call["function"]
        out.append(_head_delta({"id": call["id"], "name": function["name"]}, i))
        out.append(_arguments_delta(function["arguments"], i))
    return out


__all__ = [
    "TOOLS_PROMPT",
    "HeldCall",
    "Tool",
    "Tools",
    "call_deltas",
    "call_lark",
    "call_schema",
    "parse_call",
    "parse_tools",
    "render_messages",
]
