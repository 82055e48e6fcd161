"""Fixtures shared by the whole suite, and every test's time limit.

Time limits (pytest-timeout; a hung test fails with a stack dump, CI never stalls):

- a test's own ``@pytest.mark.timeout(s)`` (or its module's) wins;
- ``--timeout=S`` replaces the unit tests' limit, ``--timeout=0`` lifts every limit;
- otherwise ``multiprocess``, ``netns`` and ``model`` tests get
  :data:`PROCESS_TIMEOUT_S` (node processes, a real model, a loaded 2-core
  machine), other ``slow`` tests :data:`SLOW_TIMEOUT_S`, and everything else
  the ``timeout`` in pyproject.toml (unit tests: tight).

A plain test is interrupted by SIGALRM and fails with its stack. A trio test
must not be: a signal raised inside trio's run loop corrupts it for the next
test. So a trio test runs under ``trio.fail_after(limit)``, which cancels it
where it waits (the traceback shows where) and tears its fixtures down;
pytest-timeout's thread method stays behind it, ``GRACE_S`` later, for a test
wedged where trio cannot cancel it (a thread that never returns): it dumps
every thread's stack and ends the run.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

# One OpenMP (torch) thread in the test process and in every process it starts, as a
# node has by default (``--threads 1``), unless the caller set it. On the shared
# 2-core machines the suite runs on, a team as wide as the machine spin-waits against
# the other load: one `hetmesh generate` of 24 tokens took 40-52 s under load with
# the default two threads and 10-14 s with one. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

PROCESS_TIMEOUT_S = 600.0
SLOW_TIMEOUT_S = 300.0
GRACE_S = 60.0

# how the suite is split across xdist workers
pytest_plugins = ["tests.scheduling"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a safetensors folder.

    Pulled once into the user's hetmesh cache ($HETMESH_HOME or the XDG cache),
    so later runs reuse it; a clean cache costs one offline pull (~30 s).
    """
    from hetmesh.partition.store import resolve_model

    return resolve_model()


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path) -> Path:
    """A tiny random Llama shaped like the default model, with its tokenizer (tests/tiny_model.py).

    For tests of a mechanism rather than of the default model's weights: node
    processes take it as ``--model`` (``running_mesh(..., model=tiny_model_dir)``),
    and its own single-process reference (``reference_ids(tiny_model_dir, ...)``)
    is what a mesh serving it must return. Built once into the hetmesh cache.
    """
    from hetmesh.partition.store import default_cache_dir
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(default_model_dir, default_cache_dir())


def time_limit_s(item: pytest.Item, default_s: float) -> float:
    """The time limit of ``item``: its own timeout marker, else by its kind, else the default."""
    explicit = item.get_closest_marker("timeout")
    if explicit is not None:
        value = explicit.args[0] if explicit.args else explicit.kwargs.get("timeout", default_s)
        return float(value)
    if any(item.get_closest_marker(m) for m in ("multiprocess", "netns", "model")):
        return PROCESS_TIMEOUT_S
    if item.get_closest_marker("slow"):
        return SLOW_TIMEOUT_S
    return default_s


def run_with_deadline(limit_s: float, fn: Callable[[], Awaitable[Any]], **run_kwargs: Any) -> Any:
    """``trio.run(fn)``; after ``limit_s`` seconds ``fn`` is cancelled and the test fails."""
    import trio

    scopes: list[trio.CancelScope] = []

    async def bounded() -> Any:
        with trio.fail_after(limit_s) as scope:
            scopes.append(scope)
            return await fn()

    try:
        return trio.run(bounded, **run_kwargs)
    except trio.TooSlowError:
        if scopes and scopes[0].cancelled_caught:  # ours, not the test's own fail_after
            pytest.fail(f"Timeout (>{limit_s:g}s): cancelled where it waited (traceback above)")
        raise


def _is_trio(item: pytest.Item) -> bool:
    return item.get_closest_marker("trio") is not None


@pytest.hookimpl(trylast=True)  # after pytest-trio has marked the async tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    given = config.getoption("timeout", None)  # --timeout on the command line
    if given is not None and float(given) == 0:
        _skip_gpu_tests(items)  # --timeout=0: no limits at all (a debugging session)
        return
    default_s = float(given or config.getini("timeout") or 0) or SLOW_TIMEOUT_S
    for item in items:
        limit_s = time_limit_s(item, default_s)
        if _is_trio(item) and hasattr(getattr(item, "obj", None), "hypothesis"):
            # pytest-trio runs each example with plain trio.run: no deadline inside
            item.add_marker(pytest.mark.timeout(limit_s, method="thread"), False)
        elif _is_trio(item):
            # prepended: the closest trio/timeout markers are these
            item.add_marker(pytest.mark.trio(run=partial(run_with_deadline, limit_s)), False)
            item.add_marker(pytest.mark.timeout(limit_s + GRACE_S, method="thread"), False)
        else:
            item.add_marker(pytest.mark.timeout(limit_s), False)
    _skip_gpu_tests(items)


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests where CUDA is absent (torch is imported only if any exist)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)
