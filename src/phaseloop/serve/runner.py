"""Starting a server: the decode loop's thread, the app, uvicorn on a bound socket
(``run``: until Ctrl-C; ``Background``: in a thread, for tests, benchmarks and notebooks)."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from phaseloop.errors import PhaseloopError
from phaseloop.serve.app import Server, create_app
from phaseloop.serve.engine import Engine
from phaseloop.serve.loading import Served
from phaseloop.serve.metrics import Metrics
from phaseloop.serve.net import bound_socket, is_loopback, url_of
from phaseloop.serve.schema import Limits
from phaseloop.serve.web import missing_extra


@dataclass(frozen=True)
class Config:
    """How the server runs (``phaseloop serve``'s flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 256
    timeout: float = 600.0
    max_context: int | None = None  # default: the model's max_seq_len
    max_body_bytes: int = 1 << 20

    def check(self) -> None:
        for name in ("max_batch", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise PhaseloopError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if not self.timeout > 0:
            raise PhaseloopError(f"--timeout {self.timeout}: must be a positive number of seconds")
        if self.max_context is not None and self.max_context < 2:
            raise PhaseloopError(f"--max-context {self.max_context}: must be >= 2 tokens")
        if self.api_key is not None and not self.api_key.strip():
            raise PhaseloopError("--api-key is empty; give a key, or leave the flag out")


def build(served: Served, cfg: Config) -> Server:
    """The server object (engine started) behind the app."""
    cfg.check()
    limits = Limits(max_context=cfg.max_context or served.model.cfg.max_seq_len,
                    vocab_size=served.model.cfg.vocab_size, max_body_bytes=cfg.max_body_bytes)
    metrics = Metrics()
    engine = Engine(served.model, max_batch=cfg.max_batch, max_queue=cfg.max_queue, metrics=metrics).start()
    return Server(served, engine, limits, metrics, cfg.api_key, cfg.timeout)


def warnings(cfg: Config) -> list[str]:
    if is_loopback(cfg.host):
        return []
    key = "every route but /health needs the API key" if cfg.api_key else \
        "and without --api-key anyone who can reach it may use it"
    return [f"warning: serving on {cfg.host}, reachable from other machines; {key} "
            "(use --host 127.0.0.1 to keep it local)"]


def _uvicorn():
    try:
        import uvicorn
    except ImportError as e:
        missing_extra(e)
    return uvicorn


def run(served: Served, cfg: Config) -> int:
    """Serve until Ctrl-C (or SIGTERM: the command then exits 143, as every command does)."""
    uvicorn = _uvicorn()
    sock = bound_socket(cfg.host, cfg.port, fallback=False)
    server = build(served, cfg)
    for line in warnings(cfg):
        print(line, file=sys.stderr)
    sock.listen(2048)  # connections made from now on wait for uvicorn in the backlog
    url = url_of(cfg.host, sock.getsockname()[1])
    print(f"phaseloop serve: {served.name} at {url}/v1 (Ctrl-C to stop)", flush=True)
    web = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning", access_log=False))
    try:
        with sock:
            web.run(sockets=[sock])
    finally:
        server.engine.stop()
    return 0


class Background:
    """A server in a daemon thread on a free loopback port (``url``); ``close()`` stops it."""

    def __init__(self, served: Served, cfg: Config = Config(port=0), timeout: float = 30.0):
        uvicorn = _uvicorn()
        self.sock = bound_socket(cfg.host, cfg.port)
        self.server = build(served, cfg)
        self.url = url_of(cfg.host, self.sock.getsockname()[1])
        self.web = uvicorn.Server(uvicorn.Config(create_app(self.server), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.web.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="phaseloop-serve")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.web.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise PhaseloopError(f"serve: the server on {self.url} did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.web.should_exit = True
        self.thread.join(timeout=30)
        self.server.engine.stop()
        self.sock.close()

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
