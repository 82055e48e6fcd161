"""Headless Chromium for the dashboard tests: Debian's browser and driver, never downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        return "needs Debian's chromium and chromium-driver (scripts/bootstrap installs them)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (the dev extra)"
    return None


def open_chromium(profile: Path) -> Any:
    """A headless Chromium driven through /usr/bin/chromedriver, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)  # never a downloaded browser
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,1000",
    ):
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER))  # never a downloaded driver
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    return driver


def until(driver: Any, predicate: Any, timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` (stale elements count as not yet) until truthy; fail clearly."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver, timeout_s, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException]
    )
    try:
        return wait.until(lambda d: predicate())
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def read(driver: Any, selector: str, attribute: str | None = None) -> list[str]:
    """The rendered text (or ``attribute``) of every element matching ``selector``, read
    in the page in one step: never stale, though the page re-renders every snapshot."""
    script = (
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".map(e => arguments[1] === null ? e.innerText : (e.getAttribute(arguments[1]) || ''))"
    )
    return list(driver.execute_script(script, selector, attribute))
