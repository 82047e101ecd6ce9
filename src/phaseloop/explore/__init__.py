"""`phaseloop explore`: a local web app over the library.

Every number a page shows comes from an endpoint under ``/api/`` that calls phaseloop's
own functions (``params``, ``act``, ``tasks.parity_demo``, the trained model): the pages
hold layout and plotting only, never a second copy of an equation.

Layout:
- ``app.py``      the Starlette app: pages, ``/api`` routes, static files, error handling
- ``context.py``  what a server may read (the folders given), input checks, the model cache
- ``learn.py``    Learn pages and endpoints (UT explainer sections, 3PT, Hyperloop)
- ``runs.py``     run / comparison folders: curves, tables, plots
- ``inside.py``   inside a trained model: per-token loss, ponder map, angles, streams
- ``notebook.py`` ``show(run_dir, page=...)``: the pages inline in a notebook (IPython IFrame)
Each page module exposes ``routes(ctx) -> list[Route]`` and ``PAGES`` (nav entries).

Needs the ``explore`` extra (starlette, uvicorn, jinja2, plotly).
"""


def show(paths=(), page: str = "/", width="100%", height: int = 800):
    """The explore page ``page`` for ``paths``, inline in a notebook (``notebook.show``)."""
    from phaseloop.explore.notebook import show as _show

    return _show(paths, page, width, height)
