"""``hetmesh demo --keep``: prints the dashboard's URL, keeps the mesh up, stops on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(400),
]

REPO = Path(__file__).resolve().parents[3]


def _lines(stream: object, out: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        out.put(line)


def test_demo_keep_serves_the_dashboard_until_sigterm(default_model_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("OMP_NUM_THREADS", "2")
    argv = [sys.executable, "-m", "hetmesh", "demo", "--keep", "--max-new-tokens", "4", "Hi"]
    demo = subprocess.Popen(  # its own process group: the nodes are reaped with it
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    err: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=_lines, args=(demo.stderr, err), daemon=True).start()
    threading.Thread(target=_lines, args=(demo.stdout, queue.Queue()), daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                line = err.get(timeout=1)
            except queue.Empty:
                assert demo.poll() is None, f"the demo exited early:\n{''.join(seen)}"
                continue
            seen.append(line)
            if line.startswith("dashboard: "):
                url = line.split(" ", 1)[1].strip()
            if "Ctrl-C stops it" in line:
                break
        else:
            raise AssertionError(f"the demo never said it keeps the mesh up:\n{''.join(seen)}")
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200
        assert "hetmesh dashboard" in page.text
        assert httpx.get(f"{url}health", timeout=10).status_code == 200
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}health", timeout=5)  # every node stopped with the demo
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)  # whatever is left: demo and nodes
        demo.wait(timeout=30)
