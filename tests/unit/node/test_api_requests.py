"""The HTTP API's pure parts: per-client bookkeeping and the prompt's size before tokenising."""

from __future__ import annotations

import pytest

from hetmesh.node.api_requests import ApiError, ClientLimits, check_prompt_chars, prompt_chars
from hetmesh.protocol.generate import GenerateRequest


def test_client_limits_count_each_client_apart_and_forget_idle_ones() -> None:
    limits = ClientLimits(2)
    assert limits.acquire("a")
    assert limits.acquire("a")
    assert not limits.acquire("a")  # its third at once
    assert limits.acquire("b")  # another client is not affected
    limits.release("a")
    assert limits.acquire("a")
    for client in ("a", "a", "b"):
        limits.release(client)
    assert limits.active("a") == limits.active("b") == 0
    assert limits._active == {}  # nothing kept per client once it holds no slot
    with pytest.raises(ValueError, match="at least 1"):
        ClientLimits(0)


def test_prompt_size_is_checked_in_characters_before_tokenising() -> None:
    messages = ({"role": "user", "content": "ab"}, {"role": "system", "content": "cde"})
    assert prompt_chars(GenerateRequest(messages=messages, chat=True)) == 5
    assert prompt_chars(GenerateRequest(prompt="abcd")) == 4
    assert prompt_chars(GenerateRequest(prompt_ids=(1, 2, 3))) == 0
    check_prompt_chars(GenerateRequest(prompt="x" * 128), context=1)  # may fit: let it through
    with pytest.raises(ApiError) as caught:
        check_prompt_chars(GenerateRequest(prompt="x" * 129), context=1)
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
