"""Which of a node's threads the kernel runs first when they wait for the same core.

On a small machine a stage's forward (a link's reader thread, or the device
thread) waits for a core behind the node's control plane (trio's thread:
gossip, plans, libp2p), the other nodes' and the client's work; a token of a
cut is sequential over its stages, so every such wait is the stream's
(issue 42: ~2 ms of run-queue wait a token across three nodes).

``HETMESH_CONTROL_NICE=N`` (0, the default, leaves everything as it is) makes
trio's thread N nicer than the process (:func:`nice_control_thread`, called
once on it): where both want the core, the kernel's fair scheduler gives the
data path the larger share. Linux threads take their creator's nice, so
threads trio starts afterwards (a link's reader, trio's worker threads that run
a stage's batches) start as nice as trio's; each data-path thread calls
:func:`data_path_thread` once to go back to the process's own nice. Going back
down needs the right to lower a nice (root, ``CAP_SYS_NICE`` or
``RLIMIT_NICE``); without it that thread keeps trio's nice and the node runs
as if all of it were N nicer (no worse among its own threads than before).

Linux only (per-thread nice); elsewhere, and on any error, nothing changes.
No trio, no torch.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

CONTROL_NICE_ENV = "HETMESH_CONTROL_NICE"
MAX_NICE = 19

_base: int | None = None  # the process's nice before trio's thread was made nicer
_local = threading.local()


def control_nice() -> int:
    """How much nicer trio's thread runs (``HETMESH_CONTROL_NICE``; 0: as the process;
    a bad value: 0), within [0, 19]."""
    try:
        value = int(os.environ.get(CONTROL_NICE_ENV, "0"))
    except ValueError:
        return 0
    return max(0, min(value, MAX_NICE))


def _thread_id() -> int:
    return threading.get_native_id()


def _set_nice(value: int) -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, _thread_id(), value)  # one thread on Linux
    except (OSError, AttributeError):
        return False
    return True


def nice_control_thread() -> int | None:
    """On trio's thread, once: make it :func:`control_nice` nicer than the process;
    its new nice, or None when nothing changed (0, not Linux, or refused)."""
    global _base
    step = control_nice()
    if step == 0 or not hasattr(os, "setpriority") or not _is_linux():
        return None
    base = os.getpriority(os.PRIO_PROCESS, _thread_id())
    if _base is None:
        _base = base
    target = min(_base + step, MAX_NICE)
    if not _set_nice(target):
        log.warning("cannot make the control thread nicer (%s=%d)", CONTROL_NICE_ENV, step)
        return None
    return target


def data_path_thread() -> None:
    """On a data-path thread (a link's reader, a stage's device thread), once per thread:
    back to the process's nice if trio's thread was made nicer (cheap after the first)."""
    if getattr(_local, "done", False):
        return
    _local.done = True
    base = _base
    if base is None:
        return
    if os.getpriority(os.PRIO_PROCESS, _thread_id()) != base and not _set_nice(base):
        log.debug("data-path thread %d keeps the control thread's nice", _thread_id())


def _is_linux() -> bool:
    return os.uname().sysname == "Linux"


__all__ = ["CONTROL_NICE_ENV", "control_nice", "data_path_thread", "nice_control_thread"]
