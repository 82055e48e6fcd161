"""The dashboard's login (a wrong key, then the right one) and its reconnecting by itself
after the node's API went away and came back.

No mesh: the real API app (Starlette + Hypercorn on trio, with an API key)
serves a one-peer view from a thread of this process, is stopped and started
again on the same port, while headless Chromium watches.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import pytest
import trio

from hetmesh.node.api_metrics import MeshGauges
from hetmesh.node.api_serve import serve_http
from hetmesh.partition.sampling import SamplingParams
from hetmesh.protocol.generate import GenerateRequest
from tests.integration.dashboard.dashboard_browser import css, missing, open_chromium, read, until
from tests.integration.node.inprocess_mesh import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PEER = "12D3KooWReconnectTestPeer"
KEY = "reconnect-test-key"


class OnePeer:
    """Just enough of a node for the page: one peer, no plan, no generation."""

    def models(self) -> list[str]:
        return ["fake-model"]

    def max_context(self) -> int:
        return 16

    def ready(self) -> bool:
        return True

    async def encode(self, request: GenerateRequest) -> list[int]:
        return [1]

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str], None]:
        yield -1, ""

    def gauges(self) -> MeshGauges:
        return MeshGauges(ready=True)

    def view(self) -> dict[str, Any]:
        record = {"addrs": ["/ip4/127.0.0.1/tcp/1"], "devices": [], "stages": [], "load": {}}
        return {"self": PEER, "peers": [{"peer_id": PEER, "health": "self", "record": record}]}

    def for_model(self, model: str) -> Any:
        return self


class Server:
    """``serve_http`` in a thread with its own trio loop, stoppable and restartable."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.up = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.stop.clear()
        self.up.clear()
        self.thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self.thread.start()
        assert self.up.wait(30), "the API did not start"

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            serve = functools.partial(serve_http, OnePeer(), port=self.port, api_key=KEY)
            await nursery.start(serve)
            self.up.set()
            await trio.to_thread.run_sync(self.stop.wait)
            nursery.cancel_scope.cancel()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive(), "the API did not stop"


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server(free_port())
    running.start()
    try:
        yield running
    finally:
        running.close()


def test_the_page_logs_in_and_reconnects_by_itself(server: Server, tmp_path: Any) -> None:
    from selenium.webdriver.common.keys import Keys

    reason = missing()
    if reason:
        pytest.skip(reason)
    driver = open_chromium(tmp_path / "profile")
    try:
        driver.get(f"http://127.0.0.1:{server.port}/")
        state = driver.find_element("id", "connection")
        until(driver, lambda: state.text == "locked", 30, "the login form")
        key = driver.find_element("id", "api-key")
        key.send_keys("wrong" + Keys.ENTER)
        error = driver.find_element("id", "login-error")
        until(driver, lambda: "refused" in error.text, 30, "the wrong key to be refused")
        assert css(driver, ".card") == []
        assert not driver.find_element("id", "dash").is_displayed()
        key.send_keys(KEY + Keys.ENTER)
        until(driver, lambda: state.text == "live", 30, "the page to go live")
        until(driver, lambda: len(css(driver, ".card")) == 1, 30, "the one peer's card")
        # read in the page in one step: the card re-renders with every snapshot
        (card,) = read(driver, ".card")
        assert "alive (this node)" in card
        server.close()
        until(driver, lambda: state.text == "reconnecting", 30, "the page to notice")
        server.start()
        until(driver, lambda: state.text == "live", 30, "the page to follow the node again")
        until(driver, lambda: len(css(driver, ".card")) == 1, 30, "the card again")
    finally:
        driver.quit()
