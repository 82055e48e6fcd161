"""The bodies of a completion's answer: streamed as server-sent events, or whole.

:func:`sse_events` turns the :class:`~hetmesh.node.api_choices.Event` s of a
request's choices into OpenAI's chunks: for a chat, each choice's role first,
then a chunk per token (its text, ``token_ids`` and, when asked, its
``logprobs``), a last chunk per choice with its ``finish_reason``, the usage
when asked, and ``data: [DONE]``. Under active tools a choice whose output
starts with ``{`` is a call, streamed as ``tool_calls`` deltas: its id and name,
then its arguments token by token (:class:`~hetmesh.node.api_tools.HeldCall`).
An error ends the stream with an OpenAI error body. :func:`choice_body` is one
choice of a whole answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import trio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hetmesh.node.api_choices import Choice, Event, LogprobsShape
from hetmesh.node.api_requests import ApiError, ApiRequest, api_error
from hetmesh.node.api_tools import HeldCall, parse_call
from hetmesh.protocol.generate import finish_reason
from hetmesh.protocol.logprobs import logprobs_of


class HeldStream(StreamingResponse):
    """A streamed response that gives its client's slot back when it is done, sent or not
    (a client gone before the first chunk never starts the body's generator)."""

    def __init__(
        self, content: AsyncIterator[str], release: Callable[[], None], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def next_event(receive: trio.MemoryReceiveChannel[Event]) -> Event | None:
    """The next event of a completion's choices; None once every choice has ended."""
    try:
        return await receive.receive()
    except trio.EndOfChannel:
        return None


class Chunks:
    """The chunks of one streamed completion, as SSE lines."""

    def __init__(self, parsed: ApiRequest, texts: Callable[[Sequence[int]], list[str]]) -> None:
        self.parsed = parsed
        self.chat = parsed.chat
        self.id = new_id(self.chat)
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.shapes = [LogprobsShape(texts, chat=self.chat) for _ in range(parsed.n)]

    def chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.parsed.model,
            "choices": choices,
        }
        if use is not None:
            body["usage"] = use
        return f"data: {json.dumps(body)}\n\n"

    def piece(self, index: int, text: str, token: int, reason: str | None = None) -> str:
        """A chunk of one choice: ``text`` from ``token`` (-1: none), or its end."""
        out: dict[str, Any] = {"index": index, "finish_reason": reason}
        if self.chat:
            out["delta"] = {"content": text} if text or reason is None else {}
        else:
            out["text"] = text
        logprobs = None
        if self.parsed.logprobs and token >= 0:
            info = logprobs_of(token)
            logprobs = self.shapes[index].render([(int(token), info)] if info else [])
        out["logprobs"] = logprobs
        out["token_ids"] = [int(token)] if token >= 0 else []
        return self.chunk([out])


def choice_body(
    parsed: ApiRequest,
    max_new_tokens: int,
    index: int,
    choice: Choice,
    texts: Callable[[Sequence[int]], list[str]],
) -> dict[str, Any]:
    """One choice of a whole (not streamed) completion: its text or tool call."""
    out: dict[str, Any] = {
        "index": index,
        "finish_reason": finish_reason(len(choice.tokens), max_new_tokens),
    }
    logprobs = None
    if parsed.logprobs:
        logprobs = LogprobsShape(texts, chat=parsed.chat).render(choice.logprobs)
    text = "".join(choice.text)
    if parsed.chat:
        out["message"] = {"role": "assistant", "content": text}
        calls = parse_call(text, parsed.tools)
        if calls is not None:
            out["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            out["finish_reason"] = "tool_calls"
    else:
        out["text"] = text
    out["logprobs"] = logprobs
    out["token_ids"] = choice.tokens
    return out


async def sse_events(
    parsed: ApiRequest,
    prompt_tokens: int,
    max_new_tokens: int,
    first: Event,
    receive: trio.MemoryReceiveChannel[Event],
    texts: Callable[[Sequence[int]], list[str]],
    *,
    on_token: Callable[[], None],
    on_error: Callable[[ApiError], None],
) -> AsyncIterator[str]:
    """The SSE lines of a completion whose choices' events come from ``receive``
    (``first`` already taken); ``on_token`` per generated token, ``on_error`` for
    an error that ends it."""
    out = Chunks(parsed, texts)
    n = parsed.n
    if parsed.chat:
        role = {"role": "assistant", "content": ""}
        for i in range(n):
            yield out.chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
    tools = parsed.tools if parsed.tools is not None and parsed.tools.active else None
    held = [HeldCall(tools) if tools else None for _ in range(n)]
    counts = [0] * n
    event: Event | None = first
    with receive:
        while event is not None:
            index, call = event.index, held[event.index]
            if event.what == "token":
                if event.token >= 0:
                    counts[index] += 1
                    on_token()
                text = call.feed(event.text) if call is not None else event.text
                if call is None or text or not call.calling:
                    yield out.piece(index, text, event.token)
                for delta in call.deltas() if call is not None else ():  # token by token
                    yield out.chunk([{"index": index, "delta": delta, "finish_reason": None}])
            elif event.what == "end":
                reason: str = finish_reason(counts[index], max_new_tokens)
                calls, rest, deltas = call.finish() if call is not None else (None, "", [])
                if rest:
                    yield out.piece(index, rest, -1)
                for delta in deltas:
                    yield out.chunk([{"index": index, "delta": delta, "finish_reason": None}])
                yield out.piece(index, "", -1, "tool_calls" if calls else reason)
            else:
                assert event.error is not None
                err = api_error(event.error)
                on_error(err)
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            event = await next_event(receive)
        else:
            if parsed.include_usage:
                yield out.chunk([], usage(prompt_tokens, sum(counts)))
    yield "data: [DONE]\n\n"


__all__ = ["Chunks", "HeldStream", "choice_body", "new_id", "next_event", "sse_events", "usage"]
