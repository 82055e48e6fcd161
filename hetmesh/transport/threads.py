"""Blocking calls from trio, without importing torch (the links module does)."""

from __future__ import annotations

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
