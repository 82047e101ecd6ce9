"""Fixtures for explore's tests (issue 26): a live server and a real headless Chromium.

``explore_server(paths)`` serves the app on a free loopback port in a thread;
``browser`` is Selenium driving Debian's ``chromium`` + ``chromium-driver`` (installed by
.ci/run). Without them the browser tests skip saying why (CI=true makes that a failure).
Screenshots go to docs/explore/ when ``PHASELOOP_SCREENSHOTS=1``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "explore"


def _absent(why: str):
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI=true: {why}")
    pytest.skip(why)


@pytest.fixture
def explore_server():
    """Call with a list of folders; returns the base URL of a running server."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import uvicorn

    from phaseloop.explore.app import create_app
    from phaseloop.explore.context import ServerContext
    from phaseloop.explore.web import free_port

    servers = []

    def start(paths=()):
        app = create_app(ServerContext.from_paths(list(paths)))
        port = free_port("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 20
        while not server.started:
            if time.time() > deadline:
                raise RuntimeError("explore server did not start in 20 s")
            time.sleep(0.05)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium through Selenium (Debian's chromium + chromium-driver)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _absent("explore's browser tests need selenium (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        _absent("explore's browser tests need Debian's chromium and chromium-driver "
                "(apt-get install chromium chromium-driver; .ci/run does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def screenshot(driver, name: str) -> None:
    """Save a screenshot to docs/explore/NAME.png when PHASELOOP_SCREENSHOTS=1."""
    if os.environ.get("PHASELOOP_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


# every attribute naming a URL, in the live DOM (plotly's mode bar included), and every
# resource the page fetched: what lies outside the page's own server
_EXTERNAL_JS = """
const out = [], own = location.origin, web = ["http:", "https:", "ws:", "wss:", "ftp:"];
const outside = v => { try { const u = new URL(v, location.href); return web.includes(u.protocol) && u.origin !== own; }
                       catch (e) { return false; } };
const named = ["href", "src", "action", "formaction", "poster", "data", "srcset", "background"];
for (const el of document.querySelectorAll("*"))
  for (const a of el.getAttributeNames())
    if ((named.includes(a) || a.endsWith(":href")) && outside(el.getAttribute(a).split(/[ ,]/)[0]))
      out.push(`<${el.tagName.toLowerCase()} ${a}="${el.getAttribute(a)}">`);
for (const r of performance.getEntriesByType("resource")) if (outside(r.name)) out.push(`fetched ${r.name}`);
return out;
"""


def external_urls(driver) -> list[str]:
    """The URLs outside the app that the rendered page (its live DOM, after its scripts
    ran) links to or loaded: [] for an offline page."""
    return driver.execute_script(_EXTERNAL_JS)
