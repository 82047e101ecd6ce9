"""The explore web app: Starlette routes for pages and ``/api`` endpoints.

Pages are Jinja2 templates (``templates/``) that fetch their numbers from ``/api/...``
with ``static/explore.js`` (every ``/api/`` answer is JSON, errors included); charts use
the plotly.min.js shipped in the plotly wheel, served from ``/static/plotly.min.js`` (no
CDN, no external URL anywhere).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from phaseloop.errors import PhaseloopError
from phaseloop.explore import inside, learn, runs
from phaseloop.explore.context import ServerContext
from phaseloop.explore.web import (
    HERE,
    FileResponse,
    Mount,
    Route,
    Starlette,
    StaticFiles,
    api_errors,
    missing_extra,
    page,
)
from phaseloop.serve.net import bound_socket, is_loopback, url_of

PAGE_MODULES = (learn, runs, inside)  # the nav's order: Learn, Runs, Inside


def create_app(ctx: ServerContext | None = None) -> Starlette:
    ctx = ctx or ServerContext()
    routes: list = [Route("/", page("index.html", "phaseloop explore"))]
    nav: list[dict] = []
    for mod in PAGE_MODULES:
        routes += mod.routes(ctx)
        nav += mod.PAGES
    plotly_js = _plotly_js()
    routes += [
        Route("/static/plotly.min.js", lambda request: FileResponse(plotly_js)),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers=api_errors())
    app.state.ctx = ctx
    app.state.nav = nav
    groups: dict[str, list[dict]] = {}  # in registration order: Learn, Runs, Inside
    for item in nav:
        groups.setdefault(item["group"], []).append(item)
    app.state.nav_groups = list(groups.items())
    return app


def _plotly_js() -> Path:
    try:
        import plotly
    except ImportError as e:
        missing_extra(e)
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise PhaseloopError(f"plotly's bundled plotly.min.js is missing ({path}); reinstall "
                             "plotly: pip install --force-reinstall plotly")
    return path


def serve(paths: list[str] = (), host: str = "127.0.0.1", port: int = 0,
          open_browser: bool = True, ready: Callable[[str], None] | None = None) -> int:
    """Serve the app until Ctrl-C; prints the URL (and opens a browser unless told not to)."""
    try:
        import uvicorn
    except ImportError as e:
        missing_extra(e)
    ctx = ServerContext.from_paths(list(paths))
    app = create_app(ctx)
    sock = bound_socket(host, port)
    port = sock.getsockname()[1]
    url = url_of(host, port) + "/"
    if not is_loopback(host):
        print(f"warning: serving on {host}, reachable from other machines; explore has no "
              "login (use --host 127.0.0.1 to keep it local)", file=sys.stderr)
    print(f"phaseloop explore: {url}  (Ctrl-C to stop)", flush=True)
    if ready:
        ready(url)
    if open_browser:
        import webbrowser
        webbrowser.open(url)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    with sock:
        server.run(sockets=[sock])
    return 0
