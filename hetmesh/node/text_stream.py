"""A request's tokens in, text deltas out: what the node's two front doors share.

The libp2p generate RPC (:meth:`hetmesh.node.serving.Serving._handle_generate`)
and the HTTP API (through :class:`hetmesh.node.backend.NodeBackend`) both
encode a request with :func:`encode_request` and stream its tokens with
:func:`text_stream` over the node's gateway.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from hetmesh.discovery import wire
from hetmesh.errors import MeshError
from hetmesh.protocol.generate import (
    MAX_REQUEST_BYTES,
    Delta,
    Finish,
    GenerateRequest,
    SamplingParams,
    error_reply,
    finish_reason,
)

if TYPE_CHECKING:
    from hetmesh.node.gateway import Gateway


def encode_request(tokenizer: Any, request: GenerateRequest) -> list[int]:
    """Token ids of a request: given ids, a conversation, or a prompt (``chat``: templated).

    Blocking (it runs the tokenizer). ``InvalidRequest`` for a malformed conversation.
    """
    from hetmesh.partition.text import encode_messages, encode_prompt

    if request.prompt_ids:
        return list(request.prompt_ids)
    if request.messages is not None:
        return encode_messages(tokenizer, list(request.messages))
    return encode_prompt(tokenizer, request.prompt or "", chat=request.chat)


async def text_stream(
    gateway: Gateway, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams
) -> AsyncGenerator[tuple[int, str], None]:
    """Token ids with their text deltas (-1: a last text-only delta); stops at EOS,
    ``max_new_tokens`` or a stop string."""
    from hetmesh.partition.text import StopMatcher, TextStream

    text = TextStream(tokenizer)
    stops = StopMatcher(params.stop)
    async with contextlib.aclosing(gateway.generate(prompt_ids, params)) as tokens:
        async for token in tokens:
            delta = stops.feed(text.push(token))
            yield token, delta
            if stops.stopped:
                return
    tail = stops.feed(text.flush()) + stops.flush()
    if tail:
        yield -1, tail


# frames a generate stream holds while its write is in flight (a slow client): past
# these the generation waits for the client, as it did when it wrote each token itself
WAITING_FRAMES = 64


async def answer_generate(
    stream: Any,
    encode: Callable[[GenerateRequest], list[int]],
    generate: Callable[[Sequence[int], SamplingParams], AsyncGenerator[tuple[int, str], None]],
) -> None:
    """Answer one generate RPC on ``stream``: read the request, ``encode`` it (off the
    event loop), write each delta of ``generate`` and one finish, or the error
    (through :func:`write_frames`: deltas that come while a write is in flight go out
    together)."""
    payload = await wire.read_frame(stream, max_bytes=MAX_REQUEST_BYTES, timeout_s=10.0)
    data = wire.decode_map(payload, max_bytes=MAX_REQUEST_BYTES)
    count = 0
    async with trio.open_nursery() as nursery:
        # the client sends nothing after its request: its stream ending (it closed or
        # reset it, or its host went away) means nobody reads the tokens any more, so
        # the generation stops there instead of running on to max_new_tokens
        nursery.start_soon(cancel_when_closed, stream, nursery.cancel_scope)
        send, frames = trio.open_memory_channel[bytes](WAITING_FRAMES)
        async with trio.open_nursery() as writing:  # all written before it ends
            writing.start_soon(write_frames, stream, frames)
            async with send:
                try:
                    request = GenerateRequest.from_wire(data)
                    ids = await trio.to_thread.run_sync(encode, request)  # off the event loop
                    params = request.sampling
                    async with contextlib.aclosing(generate(ids, params)) as events:
                        async for token, text in events:
                            if token >= 0:
                                count += 1
                            delta = Delta(text, token if token >= 0 else None)
                            await send.send(wire.encode(delta.to_wire()))
                    done = Finish(finish_reason(count, params.max_new_tokens), len(ids), count)
                    await send.send(wire.encode(done.to_wire()))
                except MeshError as exc:
                    await send.send(wire.encode(error_reply(exc)))
        nursery.cancel_scope.cancel()  # done: stop watching the stream


async def write_frames(stream: Any, frames: trio.MemoryReceiveChannel[bytes]) -> None:
    """Write each message of ``frames``, length-prefixed, as it comes, until the channel
    closes; the messages that came while a write was in flight go out together, in one
    write (one yamux frame, one noise message, one send: most of a token's cost at the
    gateway, 2026-12-14-fast-cut-9e.md). Nothing waits for company: a message alone
    goes at once. The bytes on the stream are the same; the readers take them as
    they always did (a message a frame)."""
    async with frames:
        async for first in frames:
            batch = [wire.frame_prefix(len(first)), first]
            while len(batch) < 2 * WAITING_FRAMES:
                try:
                    message = frames.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                batch += (wire.frame_prefix(len(message)), message)
            await stream.write(b"".join(batch))


async def cancel_when_closed(stream: Any, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``stream`` yields anything past the request: an end of
    stream, a reset, or bytes the protocol does not allow."""
    with contextlib.suppress(Exception):  # any failure to read is the client gone too
        await stream.read(1)
    scope.cancel()


__all__ = [
    "WAITING_FRAMES",
    "answer_generate",
    "cancel_when_closed",
    "encode_request",
    "text_stream",
    "write_frames",
]
