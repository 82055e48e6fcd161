"""Structured output for the HTTP API: ``response_format`` (and tool calls) as grammars.

A JSON schema becomes llguidance grammar text
(:func:`hetmesh.partition.grammar.json_schema_grammar`) here, at the gateway,
once per request and off the event loop; the last stage enforces it where it
samples. A schema the engine cannot enforce is refused
with a 400 naming ``response_format``.
"""

from __future__ import annotations

from typing import Any

import trio

from hetmesh.node.api_tools import Tools, call_lark
from hetmesh.partition.grammar import json_schema_grammar, lark_grammar


async def schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar text for output valid against ``schema``; ``InvalidRequest``."""
    return await trio.to_thread.run_sync(json_schema_grammar, schema)


async def tools_grammar(tools: Tools) -> str:
    """The grammar text of what ``tools``' ``tool_choice`` lets the model write ("": any)."""
    lark = call_lark(tools)
    if lark is None:
        return ""
    return await trio.to_thread.run_sync(lark_grammar, lark)


__all__ = ["schema_grammar", "tools_grammar"]
