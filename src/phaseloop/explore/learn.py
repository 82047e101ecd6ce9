"""Explore: the Learn pages — the Universal Transformer section by section,
Three-Phase and Hyperloop — each a template under ``templates/learn/`` whose numbers come
from an ``/api/learn/...`` endpoint calling phaseloop's own functions:

- ``learn_ut.py``       UT §1-§6: schedules, calculator, coordinate signal, parity, ACT
- ``learn_more.py``     3PT (phase wheel, rotation, horn, costs) and Hyperloop (layout, mixing)
- ``learn_results.py``  UT §7 (the paper's tables beside phaseloop's claim-run results) and
  §8's self-check

This module holds the page list and the routes (the input helpers are ``context``'s).
"""

from __future__ import annotations

from phaseloop.explore import learn_more, learn_results, learn_ut
from phaseloop.explore.web import Route, api, page

# (url tail, title, template) in reading order; stable URLs. The nav sorts groups
# by name (Jinja's groupby, case-insensitive): "the Universal" before "Three-Phase".
UT_PAGES = [
    ("schedules", "1 · Four schedules", "schedules.html"),
    ("equations", "2 · The update equations", "equations.html"),
    ("calculator", "3 · Parameters and FLOPs", "calculator.html"),
    ("coordinates", "4 · Coordinate signal", "coordinates.html"),
    ("parity", "5 · Prefix-parity scan", "parity.html"),
    ("act", "6 · ACT executor", "act.html"),
    ("results", "7 · What ACT learned, results", "results.html"),
    ("summary", "8 · Summary and self-check", "summary.html"),
]
OTHER_PAGES = [("3pt", "Three-Phase Transformer", "three_phase.html"),
               ("hyperloop", "Hyperloop", "hyperloop.html")]

PAGES: list[dict] = (
    [{"group": "Learn: the Universal Transformer", "title": t, "url": f"/learn/ut/{u}"} for u, t, _ in UT_PAGES]
    + [{"group": "Learn: Three-Phase, Hyperloop", "title": t, "url": f"/learn/{u}"} for u, t, _ in OTHER_PAGES])


def endpoints() -> dict:
    """``/api/learn/...`` path -> ``fn(ctx, params)``."""

    return {**learn_ut.ENDPOINTS, **learn_more.ENDPOINTS, **learn_results.ENDPOINTS}


def routes(ctx) -> list:
    out = [Route(f"/learn/ut/{u}", page(f"learn/{tpl}", t.split(" · ")[-1])) for u, t, tpl in UT_PAGES]
    out += [Route(f"/learn/{u}", page(f"learn/{tpl}", t)) for u, t, tpl in OTHER_PAGES]
    out += [Route(path, api(fn)) for path, fn in endpoints().items()]
    return out
