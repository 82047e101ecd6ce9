"""The explore web app: Starlette routes for pages and ``/api`` endpoints (issue 26).

Pages are Jinja2 templates (``templates/``) that fetch their numbers from ``/api/...``
with ``static/explore.js``; charts use the plotly.min.js shipped in the plotly wheel,
served from ``/static/plotly.min.js`` (no CDN, no external URL anywhere).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
import socket
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import PhaseloopError
from .context import BadInput, Context

HERE = Path(__file__).resolve().parent


def _missing(e: ImportError):
    raise PhaseloopError(f"phaseloop explore needs the explore extra ({e.name} is missing): "
                         "pip install 'phaseloop[explore]'") from None


try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
    from starlette.templating import Jinja2Templates
except ImportError as e:  # pragma: no cover - exercised by the missing-extra test
    _missing(e)

templates = Jinja2Templates(directory=str(HERE / "templates"))


def _finite(value: Any) -> Any:
    """JSON-safe: NaN / inf become None (JSON has no such numbers), tensors become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    return value


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(_finite(data), allow_nan=False), status_code=status,
                    media_type="application/json")


def api(fn: Callable[[Context, dict], Any]):
    """An endpoint from ``fn(ctx, params) -> JSON-able``; bad input is a 400 with the message."""

    @functools.wraps(fn)
    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        params = dict(request.query_params)
        if request.method == "POST":
            try:
                body = await request.json()
            except ValueError:
                return json_response({"error": "the request body must be JSON"}, 400)
            if not isinstance(body, dict):
                return json_response({"error": "the request body must be a JSON object"}, 400)
            params.update(body)
        params.update(request.path_params)
        try:
            return json_response(fn(ctx, params))
        except (BadInput, PhaseloopError, ValueError) as e:
            return json_response({"error": str(e).splitlines()[0] if str(e) else type(e).__name__},
                                 400)

    return endpoint


def page(template: str, title: str, **extra):
    """A page endpoint rendering ``template`` inside the base layout."""

    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        return templates.TemplateResponse(request, template, {
            "title": title, "nav": request.app.state.nav,
            "nav_groups": request.app.state.nav_groups, "roots": list(ctx.roots),
            "params": dict(request.path_params), **extra})

    return endpoint


def _modules():
    from . import inside, learn, runs
    return (learn, runs, inside)


def create_app(ctx: Context | None = None) -> "Starlette":
    ctx = ctx or Context()
    routes: list = [Route("/", page("index.html", "phaseloop explore"))]
    nav: list[dict] = []
    for mod in _modules():
        routes += mod.routes(ctx)
        nav += mod.PAGES
    plotly_js = _plotly_js()
    routes += [
        Route("/static/plotly.min.js", lambda request: FileResponse(plotly_js)),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes)
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
        _missing(e)
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise PhaseloopError(f"plotly's bundled plotly.min.js is missing ({path}); reinstall "
                             "plotly: pip install --force-reinstall plotly")
    return path


def bound_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``port`` on ``host`` if it is free, else (or for 0) to a free one the
    OS picks; the server listens on this very socket, so no other process can take the port
    between choosing it and serving."""
    for want in ([port, 0] if port else [0]):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            s.bind((host, want))
        except OSError:
            s.close()
            continue
        return s
    raise PhaseloopError(f"explore: cannot listen on {host}; pass --host 127.0.0.1")


def free_port(host: str, port: int) -> int:
    """``port`` if it can be bound on ``host``, else (or for 0) a free one (bound, then released)."""
    with bound_socket(host, port) as s:
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(paths: list[str] = (), host: str = "127.0.0.1", port: int = 0,
          open_browser: bool = True, ready: Callable[[str], None] | None = None) -> int:
    """Serve the app until Ctrl-C; prints the URL (and opens a browser unless told not to)."""
    try:
        import uvicorn
    except ImportError as e:
        _missing(e)
    ctx = Context.from_paths(list(paths))
    app = create_app(ctx)
    sock = bound_socket(host, port)
    port = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
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
