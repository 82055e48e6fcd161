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

from hetmesh.partition.grammar import json_schema_grammar


async def schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar text for output valid against ``schema``; ``InvalidRequest``."""
    return await trio.to_thread.run_sync(json_schema_grammar, schema)


__all__ = ["schema_grammar"]
