"""Listening sockets for phaseloop's local servers (``explore``, ``serve``): a socket bound
before the server starts (so no other process takes the port in between) and the
loopback test that decides whether a server warns that other machines can reach it."""

from __future__ import annotations

import ipaddress
import socket

from phaseloop.errors import PhaseloopError


def bound_socket(host: str, port: int, fallback: bool = True) -> socket.socket:
    """A socket bound to ``port`` on ``host`` if it is free, else (or for 0) to a free one the
    OS picks (``fallback`` False: ``port`` or a one-line error); the server listens on this
    very socket, so no other process can take the port between choosing it and serving."""
    for want in ([port, 0] if port and fallback else [port]):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            s.bind((host, want))
        except OSError as e:
            s.close()
            if not fallback:
                raise PhaseloopError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port "
                                     "(0: any free one) or --host") from None
            continue
        return s
    raise PhaseloopError(f"cannot listen on {host}; pass --host 127.0.0.1")


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


def url_of(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 host in brackets)."""
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
