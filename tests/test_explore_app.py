"""explore's app skeleton: safe folder resolution, input checks, no external URL (issue 26)."""

from __future__ import annotations

import os
import re

import pytest
from explore_fixtures import external_urls

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from phaseloop.explore.app import create_app
from phaseloop.explore.context import BadInput, ServerContext, number


def test_resolve_refuses_escapes(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", tmp_path / "run" / "link")
    ctx = ServerContext.from_paths([tmp_path / "run"])
    assert ctx.resolve("run", "metrics.jsonl") == (tmp_path / "run" / "metrics.jsonl").resolve()
    for bad in ("../secret", "/etc/passwd", "link", "a/../../secret"):
        with pytest.raises(BadInput):
            ctx.resolve("run", bad)
    with pytest.raises(BadInput, match="unknown folder"):
        ctx.resolve("nope")


def test_number_bounds():
    assert number({"d": "512"}, "d", lo=1, hi=10**6) == 512
    for raw in ("-1", "1000000000000", "x", "nan"):
        with pytest.raises(BadInput, match="d must be"):
            number({"d": raw}, "d", float if raw == "nan" else int, lo=1, hi=10**6)


def test_pages_reference_no_external_url():
    client = TestClient(create_app())
    urls = ["/"] + [r.path for r in client.app.routes
                    if getattr(r, "path", "").count("{") == 0 and not r.path.startswith(("/api", "/static"))]
    for url in urls:
        html = client.get(url).text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), url


def test_every_api_answer_is_json(tmp_path, monkeypatch):
    """An unknown /api path (404), a POST (405: every endpoint answers GET) and an error of
    the server (500) are JSON with the reason; other paths keep plain-text answers."""
    from phaseloop.explore import runs

    client = TestClient(create_app(), raise_server_exceptions=False)
    r = client.get("/api/nosuch")
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json()["error"].startswith("no endpoint /api/nosuch; the endpoints are /api/inside/analyze")
    for method in ("post", "put", "delete"):
        r = getattr(client, method)("/api/runs/list")
        assert r.status_code == 405 and r.json() == {"error": f"/api/runs/list answers GET, not {method.upper()}"}
        assert "GET" in r.headers["allow"]
    r = client.post("/api/learn/schedules", content=b"{not json")  # no body is read: nothing to refuse but the method
    assert r.status_code == 405 and "answers GET" in r.json()["error"]
    assert client.get("/nosuch").status_code == 404 and client.get("/nosuch").text == "Not Found"
    monkeypatch.setattr(runs.rundata, "find", lambda base: 1 / 0)
    client = TestClient(create_app(ServerContext.from_paths([tmp_path])), raise_server_exceptions=False)
    r = client.get("/api/runs/list")
    assert r.status_code == 500 and r.json() == {"error": "internal error (ZeroDivisionError); the server's log "
                                                 "has the traceback"}


def test_home_in_a_real_browser(explore_server, browser):
    base = explore_server([])
    browser.get(base + "/")
    assert "phaseloop explore" in browser.title
    assert browser.execute_script("return typeof Plotly") == "object"
    assert external_urls(browser) == []


def test_a_long_api_call_does_not_hold_up_the_others():
    """An endpoint runs in a worker thread: while one waits (a model evaluation, say),
    another is answered. On the event loop itself the first would wait out its timeout."""
    import asyncio
    import threading

    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Route

    from phaseloop.explore.web import api

    released = threading.Event()
    app = Starlette(routes=[Route("/api/wait", api(lambda ctx, p: {"released": released.wait(5)})),
                            Route("/api/release", api(lambda ctx, p: {"ok": released.set() is None}))])
    app.state.ctx = ServerContext()

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            waiting = asyncio.ensure_future(client.get("/api/wait"))
            await asyncio.sleep(0.05)
            second = (await client.get("/api/release")).json()
            return (await waiting).json(), second

    first, second = asyncio.run(both())
    assert first == {"released": True} and second == {"ok": True}


def test_a_loading_model_does_not_hold_up_the_cached_answers():
    """A miss loads under ``load_lock``: meanwhile the cache answers its hits and the other
    endpoints take ``cache_lock`` (a Runs page polling its curves); the loaded value is kept."""
    import threading
    import time

    ctx = ServerContext()
    ctx.model("a", lambda: "A")
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)
        return "B"
    loading = threading.Thread(target=lambda: ctx.model("b", slow))
    loading.start()
    assert started.wait(5)
    t0 = time.perf_counter()
    assert ctx.model("a", lambda: "not loaded again") == "A"
    assert ctx.cache_lock.acquire(timeout=2)
    ctx.cache_lock.release()
    assert time.perf_counter() - t0 < 2
    release.set()
    loading.join()
    assert ctx.model("b", lambda: "not loaded again") == "B"
