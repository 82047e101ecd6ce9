"""Explore's Runs pages: the served runs and comparisons, loss / BPB
curves that follow a training run (the page polls ``/api/runs/curves``, which reads only
what was appended to metrics.jsonl since the last poll and downsamples), several runs
overlaid, a comparison's table and plots. The data side is ``rundata`` (no web there)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from phaseloop.errors import PhaseloopError
from phaseloop.explore import rundata
from phaseloop.explore.context import BadInput, ServerContext, number
from phaseloop.explore.web import FileResponse, Request, Response, Route, api, json_response, page

PAGES = [{"group": "Runs", "title": "Runs and curves", "url": "/runs"}]
MAX_TAILS = 256  # metrics files followed at once (each holds its columns in memory)


def target(ctx: ServerContext, params: dict, want: str | None = None) -> Path:
    """The served folder ``root``/``path`` (safely resolved), a run or comparison."""
    root, rel = params.get("root"), params.get("path", "") or ""
    if not root:
        raise BadInput("root is required: the name of a served folder")
    path = ctx.resolve(str(root), str(rel))
    k = rundata.kind(path) if path.is_dir() else None
    if k is None or (want and k != want):
        raise BadInput(f"{root}/{rel} is not a {want or 'run or comparison'} folder")
    return path


def listing(ctx: ServerContext, params: dict) -> dict:
    items = []
    for root, base in ctx.roots.items():
        for k, rel in rundata.find(base):
            item = {"root": root, "path": rel, "kind": k, "name": f"{root}/{rel}" if rel else root}
            if k == "run":
                item.update(rundata.run_info(base / rel))
            items.append(item)
    return {"items": items}


def routes(ctx: ServerContext) -> list:
    tails: OrderedDict = OrderedDict()

    def curves(ctx: ServerContext, params: dict) -> dict:
        path = target(ctx, params, "run")
        max_points = number(params, "max_points", int, default=1000, lo=10, hi=100_000)
        with ctx.cache_lock:  # a tail reads on from where its last poll stopped: one reader at a time
            tail = tails.pop(path, None) or rundata.MetricsTail(path / "metrics.jsonl")
            tails[path] = tail
            while len(tails) > MAX_TAILS:
                tails.popitem(last=False)
            curves = tail.update().curves(max_points)
        return {**curves, **rundata.run_info(path)}

    def comparison(ctx: ServerContext, params: dict) -> dict:
        return rundata.comparison(target(ctx, params, "comparison"))

    async def plot(request: Request) -> Response:
        """A PNG a comparison's report wrote (one listed in its summary.json)."""
        ctx = request.app.state.ctx
        params = dict(request.query_params)
        try:
            path = target(ctx, params, "comparison")
            name = params.get("name", "")
            if name not in rundata.comparison(path)["plots"]:
                raise BadInput(f"{name!r} is not a plot of this comparison")
            rel = "/".join(p for p in (params.get("path", ""), name) if p)
            return FileResponse(ctx.resolve(params["root"], rel), media_type="image/png")
        except (PhaseloopError, ValueError) as e:  # BadInput, a damaged summary.json: a 400 with the message
            return json_response({"error": str(e).splitlines()[0] or type(e).__name__}, 400)

    return [
        Route("/runs", page("runs/index.html", "Runs and curves")),
        Route("/runs/compare", page("runs/compare.html", "Comparison")),
        Route("/api/runs/list", api(listing)),
        Route("/api/runs/curves", api(curves)),
        Route("/api/runs/comparison", api(comparison)),
        Route("/api/runs/plot", plot),
    ]
