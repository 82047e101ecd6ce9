"""What every explore page module uses: the Starlette imports (a missing extra is one
line), JSON answers (``api``: bad input is a 400 with the message) and page endpoints
(``page``: a Jinja2 template in the base layout); the listening socket is ``phaseloop.serve.net``'s."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phaseloop.errors import PhaseloopError
from phaseloop.explore.context import BadInput, ServerContext
from phaseloop.serve.net import bound_socket, free_port, is_loopback  # noqa: F401  (explore's callers import them here)

HERE = Path(__file__).resolve().parent


def missing_extra(e: ImportError):
    raise PhaseloopError(f"phaseloop explore needs the explore extra ({e.name} is missing): "
                         "pip install 'phaseloop[explore]'") from None


try:  # the app (app.py) is built from these too
    from starlette.applications import Starlette  # noqa: F401
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import FileResponse, PlainTextResponse, Response  # noqa: F401
    from starlette.routing import Mount, Route  # noqa: F401
    from starlette.staticfiles import StaticFiles  # noqa: F401
    from starlette.templating import Jinja2Templates
except ImportError as e:  # pragma: no cover - exercised by the missing-extra test
    missing_extra(e)

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


def api(fn: Callable[[ServerContext, dict], Any]):
    """A GET endpoint from ``fn(ctx, params) -> JSON-able`` (params: the query and path
    parameters); bad input is a 400 with the message. ``fn`` runs in a worker thread, so a
    long model evaluation does not hold up the other requests (the runs' curves polling)."""

    @functools.wraps(fn)
    async def endpoint(request: Request) -> Response:
        ctx: ServerContext = request.app.state.ctx
        params = {**request.query_params, **request.path_params}
        try:
            return json_response(await run_in_threadpool(fn, ctx, params))
        except (BadInput, PhaseloopError, ValueError) as e:
            return json_response({"error": str(e).splitlines()[0] if str(e) else type(e).__name__},
                                 400)

    return endpoint


API = "/api/"  # every answer under it is JSON, errors included (``api_errors``)


def api_errors() -> dict:
    """Starlette exception handlers: under ``/api/`` an unknown path (404), another method
    than GET (405) or an error of the server (500) is a JSON ``{"error": ...}``; other paths
    get Starlette's own plain-text answers."""

    async def http_error(request: Request, exc) -> Response:
        if not request.url.path.startswith(API):
            return PlainTextResponse(str(exc.detail), status_code=exc.status_code, headers=exc.headers)
        if exc.status_code == 404:
            known = sorted(r.path for r in request.app.routes if getattr(r, "path", "").startswith(API))
            why = f"no endpoint {request.url.path}; the endpoints are {', '.join(known)} (docs/explore.md)"
        elif exc.status_code == 405:
            why = f"{request.url.path} answers GET, not {request.method}"
        else:
            why = str(exc.detail)
        response = json_response({"error": why}, exc.status_code)
        response.headers.update(getattr(exc, "headers", None) or {})  # 405: Allow
        return response

    async def server_error(request: Request, exc: Exception) -> Response:
        if not request.url.path.startswith(API):
            return PlainTextResponse("Internal Server Error", status_code=500)
        return json_response({"error": f"internal error ({type(exc).__name__}); the server's log has the "
                              "traceback"}, 500)

    return {404: http_error, 405: http_error, Exception: server_error}


def page(template: str, title: str, **extra):
    """A page endpoint rendering ``template`` inside the base layout."""

    async def endpoint(request: Request) -> Response:
        ctx: ServerContext = request.app.state.ctx
        return templates.TemplateResponse(request, template, {
            "title": title, "nav": request.app.state.nav,
            "nav_groups": request.app.state.nav_groups, "roots": list(ctx.roots),
            "params": dict(request.path_params), **extra})

    return endpoint
