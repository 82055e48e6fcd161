"""The choices of one completion: ``n`` sessions over one prompt, and their log-probabilities.

:func:`produce` runs a request's ``n`` choices, each its own session through
the backend, into one channel of :class:`Event`: the first alone until its
second token (every stage has then put the prompt's full KV blocks into its
prefix cache: :data:`SHARE_AFTER`) or its end, then the others, which find the
prompt cached and prefill only its last partial block. A seeded request gives choice ``i`` the
seed ``seed + i`` (deterministic, distinct draws); a greedy one gives ``n``
equal choices. :class:`LogprobsShape` renders the log-probabilities the last
stage sent with each token (:mod:`hetmesh.protocol.logprobs`) in OpenAI's two
shapes: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``
and the legacy completion's ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from hetmesh.errors import MeshError
from hetmesh.protocol.generate import MAX_SEED, SamplingParams
from hetmesh.protocol.logprobs import TokenLogprobs, logprobs_of

log = logging.getLogger(__name__)

# the later choices start once the first has this many tokens: a stage names a prompt's
# blocks after the round that computed them, and that round ends before the stage
# computes the next step, so by the second token every stage has named them (the
# first token leaves the last stage before its round has ended)
SHARE_AFTER = 2

StreamFn = Callable[[Sequence[int], SamplingParams], AsyncGenerator[tuple[int, str], None]]


@dataclass(slots=True)
class Timing:
    """A request's clock: when it began, its first and last token, how many."""

    began: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += 1


@dataclass(frozen=True, slots=True)
class Event:
    """One thing a choice's session did: a token (``token`` -1: a text-only flush),
    its end, or an error (which ends every choice)."""

    index: int
    what: Literal["token", "end", "error"]
    token: int = -1
    text: str = ""
    error: MeshError | None = None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's sampling: choice ``i`` seeded ``seed + i`` when a seed is given."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(n)]


async def produce(
    stream: StreamFn,
    ids: Sequence[int],
    params: Sequence[SamplingParams],
    send: trio.MemorySendChannel[Event],
) -> None:
    """Run one session per entry of ``params`` into ``send`` (closed at the end):
    the first alone until its second token or its end, then the rest at once."""

    async def one(index: int, sampling: SamplingParams, first: trio.Event | None) -> None:
        try:
            seen = 0
            async with contextlib.aclosing(stream(ids, sampling)) as events:
                async for token, text in events:
                    seen += 1
                    if first is not None and seen >= SHARE_AFTER:
                        first.set()
                    await send.send(Event(index, "token", token, text))
            await send.send(Event(index, "end"))
        except MeshError as exc:
            await send.send(Event(index, "error", error=exc))
            nursery.cancel_scope.cancel()
        except Exception as exc:
            log.exception("a stream failed")
            await send.send(Event(index, "error", error=MeshError(f"internal error: {exc}")))
            nursery.cancel_scope.cancel()
        finally:
            if first is not None:
                first.set()

    with send:
        async with trio.open_nursery() as nursery:
            started = trio.Event()
            nursery.start_soon(one, 0, params[0], started)
            if len(params) > 1:
                await started.wait()
                for i in range(1, len(params)):
                    nursery.start_soon(one, i, params[i], None)


@dataclass(slots=True)
class Choice:
    """What one choice has produced so far."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    ended: bool = False

    def add(self, token: int, text: str) -> None:
        if token >= 0:
            self.tokens.append(int(token))
            info = logprobs_of(token)
            if info is not None:
                self.logprobs.append((int(token), info))
        self.text.append(text)


class LogprobsShape:
    """Renders tokens' log-probabilities as OpenAI does; ``texts`` decodes token ids."""

    def __init__(self, texts: Callable[[Sequence[int]], list[str]], *, chat: bool) -> None:
        self.texts = texts
        self.chat = chat
        self.offset = 0  # completions: characters of the choice's text before the next token

    def render(self, entries: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        ids = [t for t, _ in entries] + [i for _, info in entries for i, _ in info.top]
        names = dict(zip(ids, self.texts(ids), strict=True))
        if self.chat:
            content = [
                _entry(names[t], info.logprob)
                | {"top_logprobs": [_entry(names[i], lp) for i, lp in info.top]}
                for t, info in entries
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t, _ in entries:
            offsets.append(self.offset)
            self.offset += len(names[t])
        return {
            "tokens": [names[t] for t, _ in entries],
            "token_logprobs": [info.logprob for _, info in entries],
            "top_logprobs": [{names[i]: lp for i, lp in info.top} for _, info in entries],
            "text_offset": offsets,
        }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


__all__ = ["Choice", "Event", "LogprobsShape", "StreamFn", "Timing", "choice_params", "produce"]
