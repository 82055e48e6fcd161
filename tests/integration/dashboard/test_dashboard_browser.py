"""The dashboard in a real browser: headless Chromium (Debian's, driven by selenium) against
the three-node loopback mesh of ``hetmesh demo --keep`` (the default model), whose
API node wants a key (``$HETMESH_API_KEY``, which the demo's nodes inherit).

One mesh and one browser for the module; the tests run in order: locked page,
login and the populated page, a streamed chat, a node killed, then the demo
stopped with SIGTERM (the mesh is not the same after each of the last two).
With ``HETMESH_DASHBOARD_SCREENSHOT=path``
the populated page's screenshot is also written there (how docs/dashboard.png
is made); it always goes to the test's temporary folder.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.integration.dashboard.dashboard_browser import css, missing, open_chromium, read, until

REPO = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.timeout(600),
]

KEY = "dashboard-test-key"
CHAT = "Name a large animal."
TOKENS = 12


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    driver = open_chromium(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Node:
    pid: int
    peer_id: str
    name: str  # node1 serves the API


@dataclass
class Demo:
    proc: subprocess.Popen[str]
    api_url: str
    nodes: list[Node]
    stderr: list[str]


def _demo_nodes(demo: subprocess.Popen[str]) -> list[Node]:
    """The demo's node processes, from their command lines and node.json files."""
    out = []
    for child in psutil.Process(demo.pid).children():
        argv = child.cmdline()
        if "--data-dir" not in argv:
            continue
        data_dir = Path(argv[argv.index("--data-dir") + 1])
        info = json.loads((data_dir / "node.json").read_text())
        out.append(Node(child.pid, str(info["peer_id"]), data_dir.name))
    return sorted(out, key=lambda n: n.name)


def _read(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Demo]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, HETMESH_API_KEY=KEY, OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    argv = [sys.executable, "-m", "hetmesh", "demo", "--keep", "--max-new-tokens", "4", "Hi"]
    proc = subprocess.Popen(  # its own process group: the nodes are reaped with it
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=_read, args=(proc.stderr, lines), daemon=True).start()
    threading.Thread(target=_read, args=(proc.stdout, queue.Queue()), daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 300
        while "Ctrl-C stops it" not in "".join(seen[-1:]):
            assert time.monotonic() < deadline, f"the demo never kept its mesh:\n{''.join(seen)}"
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, f"the demo exited early:\n{''.join(seen)}"
                continue
            if seen[-1].startswith("dashboard: "):
                url = seen[-1].split(" ", 1)[1].strip().rstrip("/")
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        nodes = _demo_nodes(proc)
        assert [n.name for n in nodes] == ["node1", "node2", "node3"]
        yield Demo(proc, url, nodes, seen)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left: the demo and its nodes
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> tuple[list[int], str]:
    """Single-process greedy ids (and their text) for CHAT under the chat template."""
    import torch

    from hetmesh.partition.generate import LocalPipeline
    from hetmesh.partition.sampling import SamplingParams
    from hetmesh.partition.text import encode_prompt

    torch.set_num_threads(1)
    pipeline = LocalPipeline.load(default_model_dir, 1)
    ids = encode_prompt(pipeline.tokenizer, CHAT, chat=True)
    out = list(pipeline.generate_ids(ids, SamplingParams(max_new_tokens=TOKENS)))
    return out, str(pipeline.tokenizer.decode(out, skip_special_tokens=True))


def _status(mesh: Demo) -> dict[str, Any]:
    """The API node's view (the key is required: the page has nothing else)."""
    reply = httpx.get(
        f"{mesh.api_url}/v1/hetmesh/status", headers={"Authorization": f"Bearer {KEY}"}
    )
    reply.raise_for_status()
    view: dict[str, Any] = reply.json()
    return view


def test_without_the_key_the_page_shows_only_the_login(browser: Any, mesh: Demo) -> None:
    browser.get(f"{mesh.api_url}/")
    login = until(
        browser,
        lambda: [e for e in css(browser, "#login") if e.is_displayed()],
        60,
        "the login form",
    )[0]
    assert login.find_element("id", "api-key").get_attribute("type") == "password"
    assert not css(browser, "#dash")[0].is_displayed()
    assert css(browser, ".card") == []
    source = browser.page_source
    assert all(node.peer_id not in source for node in mesh.nodes)
    assert browser.find_element("id", "connection").text == "locked"


def test_the_page_lists_the_peers_and_the_plans_stages(
    browser: Any, mesh: Demo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from selenium.webdriver.common.keys import Keys

    browser.find_element("id", "api-key").send_keys(KEY + Keys.ENTER)  # the keyboard is enough
    peers = {n.peer_id for n in mesh.nodes}

    def cards() -> dict[str, str]:
        return {
            c.get_attribute("data-peer-id"): c.get_attribute("data-health")
            for c in css(browser, ".card")
        }

    until(browser, lambda: set(cards()) == peers, 60, "three peer cards")
    until(
        browser,
        lambda: sorted(cards().values()) == ["alive", "alive", "self"],
        60,
        "three healthy cards",
    )
    assert "alive (this node)" in browser.find_element("id", "peers").text
    assert browser.find_element("id", "connection").text == "live"
    assert browser.execute_script("return sessionStorage.getItem('hetmesh.apiKey')") == KEY
    assert KEY not in browser.current_url

    from hetmesh.scheduler.replan import newest_in_view

    def stages() -> list[tuple[str, str]]:
        boxes = css(browser, "#plan .pipeline")[0].find_elements("css selector", ".stage")
        return [
            (b.get_attribute("data-peer-id"), b.text.split("\n")[1].split(" ·")[0]) for b in boxes
        ]

    def shows_the_newest_plan() -> Any:
        """The newest plan, once the page shows its epoch and first pipeline's stages
        (a re-plan may keep the stages and move the epoch on meanwhile)."""
        plan = newest_in_view(_status(mesh))
        assert plan is not None
        expected = [(s.peer_id, f"units [{s.start}, {s.end})") for s in plan.pipelines[0].stages]
        summary = browser.find_element("id", "plan-summary").text
        return plan if stages() == expected and f"epoch {plan.epoch}" in summary else None

    plan = until(browser, shows_the_newest_plan, 60, "the newest plan's epoch and stages")
    bottlenecks = until(
        browser,
        lambda: read(browser, '#plan .stage[data-bottleneck="true"]'),
        30,
        "the bottleneck stage",
    )
    assert len(bottlenecks) == 1
    assert "bottleneck" in bottlenecks[0]
    assert len(css(browser, "#load tbody tr")) >= len(plan.pipelines[0].stages)
    # the link matrix: three rows, measured cells carry their RTT for hover and focus
    until(browser, lambda: len(css(browser, "#links tbody tr")) == 3, 30, "the link matrix")
    until(
        browser,
        lambda: any("RTT" in (c.get_attribute("title") or "") for c in css(browser, "#links td")),
        60,
        "a measured link",
    )


def test_a_chat_streams_the_reference_reply(
    browser: Any,
    mesh: Demo,
    reference: tuple[list[int], str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from selenium.webdriver.common.keys import Keys

    ids, text = reference
    for field, value in (("chat-max", str(TOKENS)), ("chat-temp", "0")):
        box = browser.find_element("id", field)
        box.clear()
        box.send_keys(value)
    browser.find_element("id", "chat-input").send_keys(CHAT + Keys.ENTER)
    done = until(
        browser,
        lambda: css(browser, '.msg.assistant:is([data-state="done"], [data-state="error"])'),
        180,
        "the streamed reply",
    )[0]
    assert done.get_attribute("data-state") == "done", done.text
    assert [int(x) for x in done.get_attribute("data-token-ids").split(",")] == ids
    assert " ".join(done.text.split()) == " ".join(text.split())
    # the request's TTFT reaches the chart within a tick or two
    chart = browser.find_element("id", "chart-ttft")
    until(browser, lambda: "latest" in (chart.get_attribute("aria-label") or ""), 30, "a TTFT")
    folder = tmp_path_factory.mktemp("screenshot")
    _screenshot(browser, folder / "dashboard.png")
    # at a phone's width the page is one column, with nothing wider than the screen
    browser.set_window_size(390, 900)
    try:
        until(
            browser,
            lambda: browser.execute_script(
                "return document.documentElement.scrollWidth <= window.innerWidth"
            ),
            10,
            "the page to fit a phone's width",
        )
        browser.save_screenshot(str(folder / "dashboard-phone.png"))
    finally:
        browser.set_window_size(1280, 1000)


# copy-heavy: the reply repeats the passage, so prompt lookup's drafts hold
COPY = (
    "Repeat this sentence three times, word for word: the quick brown fox jumps over "
    "the lazy dog near the quiet river bank."
)


def test_the_gateways_card_shows_its_speculation(
    browser: Any, mesh: Demo, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Speculative decoding is on by default: after a copy-heavy request the API
    node's card shows the drafts its gateway sent and kept (issue 48)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{mesh.api_url}/v1/models", headers=auth, timeout=30)
    models.raise_for_status()
    reply = httpx.post(
        f"{mesh.api_url}/v1/chat/completions",
        headers=auth,
        json={
            "model": models.json()["data"][0]["id"],
            "messages": [{"role": "user", "content": COPY}],
            "max_tokens": 48,
            "temperature": 0,
        },
        timeout=180,
    )
    assert reply.status_code == 200, reply.text
    gateway = mesh.nodes[0]  # node1: the API's node, where the request entered

    def line() -> str | None:
        texts = read(browser, f'.card[data-peer-id="{gateway.peer_id}"] .speculation')
        return texts[0] if texts else None

    text = until(browser, line, 60, "the gateway's speculation line")
    kept, sent = text.split("drafts kept ", 1)[1].split(" ")[0].split("/")
    assert 0 < int(kept) <= int(sent), text
    assert "tokens a verify step" in text
    folder = tmp_path_factory.mktemp("speculation")
    _screenshot(browser, folder / "dashboard-speculation.png")
    target = os.environ.get("HETMESH_SPECULATION_SCREENSHOT")
    if target:
        shutil.copyfile(folder / "dashboard-speculation.png", target)


def _screenshot(browser: Any, path: Path) -> None:
    """The whole page at 1280 px, beyond the window's height (Chromium's DevTools capture)."""
    height = int(browser.execute_script("return document.documentElement.scrollHeight"))
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1},
        },
    )
    path.write_bytes(base64.b64decode(shot["data"]))
    assert path.stat().st_size > 10_000
    target = os.environ.get("HETMESH_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copyfile(path, target)


def test_killing_a_node_turns_its_card_dead_and_logs_an_event(browser: Any, mesh: Demo) -> None:
    victim = mesh.nodes[2]
    os.kill(victim.pid, signal.SIGKILL)  # no goodbye: liveness has to notice
    killed_at = time.monotonic()

    def event() -> list[str]:
        kinds = read(browser, f'#events li[data-peer-id="{victim.peer_id}"]', "data-kind")
        return [kind for kind in kinds if kind in ("suspect", "dead")]

    def dead_card() -> list[str]:
        return read(browser, f'.card[data-peer-id="{victim.peer_id}"][data-health="dead"]')

    kinds = until(browser, event, 10, "a suspect or dead event for the killed node")
    assert set(kinds) <= {"dead", "suspect"}
    remaining = 10 - (time.monotonic() - killed_at)
    card = until(browser, dead_card, max(remaining, 0.5), "the killed node's card to turn dead")[0]
    assert "dead" in card  # a word, not only a colour


def test_the_demo_stops_its_mesh_on_sigterm(mesh: Demo) -> None:
    # still up (503 while the mesh replans around the killed node, but alive)
    assert httpx.get(f"{mesh.api_url}/health", timeout=10).json()["alive"] is True
    mesh.proc.send_signal(signal.SIGTERM)
    assert mesh.proc.wait(timeout=60) == 0
    for node in mesh.nodes:
        assert not psutil.pid_exists(node.pid) or psutil.Process(node.pid).status() == "zombie"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{mesh.api_url}/health", timeout=5)
