"""bench/pipeline.py's reading of where a stream's CPU goes (pure helpers, and /proc of
this process) and the flags its nodes start with."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "pipeline.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pipeline = _bench()


def test_the_busiest_thread_and_the_others_per_token() -> None:
    before = {1: (1.0, 0.3), 2: (0.5, 0.0), 3: (0.0, 0.0)}
    # thread 4 started meanwhile; thread 2 waited longer, thread 1 ran longer
    after = {1: (1.2, 0.32), 2: (0.56, 0.1), 3: (0.01, 0.0), 4: (0.03, 0.0)}
    busiest, others, waited = pipeline.cpu_per_token(before, after, 10)
    assert busiest == pytest.approx(20.0)  # ms a token: thread 1's 0.2 s over 10
    assert others == pytest.approx(10.0)  # 0.06 + 0.01 + 0.03 s
    assert waited == pytest.approx(2.0)  # thread 1's 0.02 s in the run queue, not thread 2's
    assert pipeline.cpu_per_token(before, after, 0) == (0.0, 0.0, 0.0)
    assert pipeline.cpu_per_token({}, {}, 10) == (0.0, 0.0, 0.0)


def test_threads_that_ended_count_in_the_rest_through_the_whole_process() -> None:
    whole = pipeline.WHOLE
    # thread 2 ran 0.3 s and ended before the second reading: only the process saw it
    before = {whole: (2.0, 0.0), 1: (1.0, 0.0), 2: (0.5, 0.0)}
    after = {whole: (2.5, 0.0), 1: (1.2, 0.0)}
    busiest, rest, _ = pipeline.cpu_per_token(before, after, 10)
    assert busiest == pytest.approx(20.0)
    assert rest == pytest.approx(30.0)  # 0.5 s of the process less the busiest's 0.2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spinning_thread_is_the_busiest_of_this_process() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    before = pipeline.thread_cpu(os.getpid())
    worker.start()
    try:
        began = time.thread_time()
        after = pipeline.thread_cpu(os.getpid())
        while after.get(worker.native_id or 0, (0.0, 0.0))[0] < 0.05:  # the spinner's CPU
            time.sleep(0.01)
            after = pipeline.thread_cpu(os.getpid())
        waited = time.thread_time() - began
    finally:
        stop.set()
        worker.join()
    assert worker.native_id in after
    assert worker.native_id not in before
    assert after[pipeline.WHOLE][0] >= after[worker.native_id][0] - 0.02  # ticks of 10 ms
    busiest, _, waited_ms = pipeline.cpu_per_token(before, after, 1)
    assert waited_ms >= 0.0
    assert busiest >= 50.0  # ms: the spinner, not this (mostly sleeping) thread
    assert busiest > waited * 1e3
    assert pipeline.thread_cpu(2**31 - 1) == {}  # no such process: nothing, no error


def test_the_mesh_does_not_speculate() -> None:
    # the reference decodes one token a step: the cut is measured against it alike
    assert "--no-speculative" in pipeline.NODE_ARGS
    assert "--speculative" not in pipeline.NODE_ARGS
