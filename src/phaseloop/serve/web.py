"""The web stack ``phaseloop serve`` runs on (Starlette + uvicorn, prometheus_client), with
one line naming the extra when a piece of it is missing."""

from __future__ import annotations

from phaseloop.errors import PhaseloopError


def missing_extra(e: ImportError):
    raise PhaseloopError(f"phaseloop serve needs the serve extra ({e.name} is missing): "
                         "pip install 'phaseloop[serve]'") from None


try:
    from starlette.applications import Starlette  # noqa: F401
    from starlette.exceptions import HTTPException  # noqa: F401
    from starlette.requests import ClientDisconnect, Request  # noqa: F401
    from starlette.responses import Response, StreamingResponse  # noqa: F401
    from starlette.routing import Route  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by the missing-extra test
    missing_extra(e)
