"""explore inside a notebook: serve in a background thread, show a page inline.

    from phaseloop.explore import show
    show("runs/quick", page="/learn/ut/act")      # an IPython IFrame of that page

One server per set of folders and process, started on first use (loopback, a free port)
and reused; IPython is imported only when ``show`` is called.
"""

from __future__ import annotations

import threading
import time

from phaseloop.errors import PhaseloopError
from phaseloop.serve.net import free_port

_SERVERS: dict[tuple, tuple] = {}  # folders -> (uvicorn.Server, thread, base URL)
_LOCK = threading.Lock()


def serve_background(paths=(), host: str = "127.0.0.1", port: int = 0, timeout: float = 20.0) -> str:
    """Start (or reuse) a server for ``paths`` in a daemon thread; returns its base URL."""
    key = (tuple(str(p) for p in paths), host)
    with _LOCK:
        if key in _SERVERS and _SERVERS[key][1].is_alive():
            return _SERVERS[key][2]
        from phaseloop.explore.app import create_app
        from phaseloop.explore.context import ServerContext
        from phaseloop.explore.web import missing_extra

        try:
            import uvicorn
        except ImportError as e:
            missing_extra(e)
        app = create_app(ServerContext.from_paths(list(paths)))
        port = free_port(host, port)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True, name="phaseloop-explore")
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise PhaseloopError(f"explore: the server on {host}:{port} did not start")
            time.sleep(0.05)
        url = f"http://{host}:{port}"
        _SERVERS[key] = (server, thread, url)
        return url


def stop_all() -> None:
    """Stop every background server (tests; a notebook's kernel stop does it too)."""
    with _LOCK:
        for server, thread, _ in _SERVERS.values():
            server.should_exit = True
            thread.join(timeout=10)
        _SERVERS.clear()


def show(paths=(), page: str = "/", width: str | int = "100%", height: int = 800):
    """An IPython IFrame of ``page`` (a path such as ``/learn/ut/act``) served for
    ``paths`` (a folder or a list of them)."""
    if not isinstance(page, str) or not page.startswith("/") or page.startswith("//"):
        raise PhaseloopError(f"page must be a path on the explore server such as '/learn/ut/act', "
                             f"got {page!r}")
    try:
        from IPython.display import IFrame
    except ImportError:
        raise PhaseloopError("phaseloop.explore.show needs IPython (run it in Jupyter, or "
                             "pip install ipython)") from None
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    return IFrame(serve_background(paths) + page, width=width, height=height)
