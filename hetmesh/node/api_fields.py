"""Which OpenAI request fields the HTTP API honours, ignores or refuses (pure).

A field that would change what a client gets back is never silently dropped:
one the API does not implement is refused with a 400 naming it. Fields that
change nothing here (bookkeeping like ``user`` or ``store``) are ignored, and
so are the ones whose value is their neutral default (``presence_penalty: 0``,
``echo: false``, ...); any other value of those is refused. The README's table
of OpenAI parameters is this module in words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# honoured by both routes (top_k: an extension)
SUPPORTED = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
    }
)
SUPPORTED_CHAT = frozenset({"messages", "top_logprobs", "response_format", "tools", "tool_choice"})
SUPPORTED_COMPLETION = frozenset({"prompt"})
# accepted and without effect on the output
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",  # a permission: the model makes at most one call a turn
    }
)
# accepted only at the value that changes nothing (None is always accepted)
NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "modalities": (["text"],),
}


def unsupported_field(body: Mapping[str, Any], *, chat: bool) -> tuple[str, str] | None:
    """The first field of ``body`` this API does not honour and why, or None."""
    own = SUPPORTED_CHAT if chat else SUPPORTED_COMPLETION
    for name in sorted(body):
        if name in SUPPORTED or name in own or name in IGNORED:
            continue
        value = body[name]
        neutral = NEUTRAL.get(name)
        if neutral is not None:
            if value is None or any(_same(value, v) for v in neutral):
                continue
            return name, f"{name}={value!r:.60} is not supported here (only {neutral[0]!r})"
        where = "/v1/chat/completions" if chat else "/v1/completions"
        return name, f"the parameter {name!r} is not supported by {where}"
    return None


def _same(value: Any, neutral: Any) -> bool:
    """Equal, and of the same kind (``False`` is not a neutral ``0``)."""
    return type(value) is type(neutral) and bool(value == neutral)


__all__ = [
    "IGNORED",
    "NEUTRAL",
    "SUPPORTED",
    "SUPPORTED_CHAT",
    "SUPPORTED_COMPLETION",
    "unsupported_field",
]
