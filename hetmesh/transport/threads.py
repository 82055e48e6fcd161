"""Blocking calls from trio, without importing torch (the links module does)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import trio

_T = TypeVar("_T")


async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run blocking ``fn`` in a worker thread; on cancellation the thread is abandoned."""
    result: _T = await trio.to_thread.run_sync(  # type: ignore[call-arg]
        fn, *args, abandon_on_cancel=True
    )
    return result


async def in_thread_always(fn: Callable[[], _T]) -> _T:
    """Run blocking ``fn`` in a worker thread that starts even when the caller is
    already cancelled, and runs to its end; a cancelled caller only stops waiting.

    For work that must finish once begun (the rest of a frame already partly on the
    wire). ``trio.to_thread.run_sync`` checks for cancellation before it starts its
    thread, so ``fn`` could then never run at all.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    result: list[Any] = []  # the thread's outcome.Outcome

    def deliver(got: Any) -> None:
        result.append(got)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    trio.lowlevel.start_thread_soon(fn, deliver)
    await done.wait()
    value: _T = result[0].unwrap()
    return value
