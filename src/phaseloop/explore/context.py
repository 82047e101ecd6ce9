"""What an explore server may read, and how its inputs are checked.

Only the folders named on the command line are served, each under a short name; a
request names a folder by that name plus a relative path, and ``..``, absolute paths and
symlinks leading outside are refused. Nothing here writes. Bad input raises
``BadInput``, which the app turns into a 400 with the message (never a 500).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from phaseloop.errors import PhaseloopError


class BadInput(PhaseloopError, ValueError):
    """A request parameter the server refuses; the message is shown on the page."""


def number(params, name: str, kind: type = int, *, default=None, lo=None, hi=None):
    """Read ``params[name]`` as ``kind`` within [lo, hi], or raise BadInput naming it."""
    raw = params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadInput(f"{name} is required")
        return default
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise BadInput(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                       f"got {str(raw)[:40]!r}") from None
    if kind is float and value != value:
        raise BadInput(f"{name} must be a number, got NaN")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadInput(f"{name} must be between {lo} and {hi}, got {value}")
    return value


def choice(params, name: str, options, default: str) -> str:
    """``params[name]`` if it is one of ``options`` (else BadInput naming them)."""
    value = params.get(name) or default
    if value not in options:
        raise BadInput(f"{name} must be one of {', '.join(map(str, options))}, got {str(value)[:40]!r}")
    return value


def flag(params, name: str, default: bool = False) -> bool:
    raw = str(params.get(name, "")).lower()
    if raw in ("", "none"):
        return default
    if raw not in ("1", "0", "true", "false", "on", "off"):
        raise BadInput(f"{name} must be true or false, got {raw[:20]!r}")
    return raw in ("1", "true", "on")


@dataclass
class ServerContext:
    """The served folders (name -> resolved path) and a bounded cache of loaded models."""

    roots: dict[str, Path] = field(default_factory=dict)
    model_cache_size: int = 2
    _models: OrderedDict = field(default_factory=OrderedDict, repr=False)
    # one model evaluation at a time: a CPU server must not run two forward passes at once
    model_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the endpoints run in worker threads (``web.api``): the caches change under this lock,
    # held for a lookup or an insertion only; a model or corpus loads under ``load_lock``
    # (one at a time), so a load holds up other loads, not the cached answers
    cache_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    load_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_paths(cls, paths: list[str | Path]) -> ServerContext:
        roots: dict[str, Path] = {}
        for p in paths:
            path = Path(p)
            if not path.is_dir():
                raise PhaseloopError(f"explore: {p} is not a folder; name a run or comparison "
                                     "folder (or none for the Learn pages)")
            path = path.resolve()
            name, k = path.name or "root", 2
            while name in roots:
                name, k = f"{path.name}-{k}", k + 1
            roots[name] = path
        return cls(roots=roots)

    def resolve(self, root: str, rel: str = "") -> Path:
        """The served path ``root/rel``; refuses unknown roots, absolute paths, ``..``, escapes."""
        if root not in self.roots:
            raise BadInput(f"unknown folder {root!r}; served: {', '.join(self.roots) or 'none'}")
        base = self.roots[root]
        rel_path = PurePosixPath(rel or ".")
        if rel_path.is_absolute() or "\\" in rel or ".." in rel_path.parts:
            raise BadInput(f"path {rel!r} must be relative to {root!r}, without '..'")
        if "\0" in rel:  # no file name holds one (os calls raise ValueError)
            raise BadInput(f"path {rel[:200]!r} holds a NUL character; no file is named so")
        path = base.joinpath(*rel_path.parts)
        try:
            # no symlink anywhere below the served root (a link could lead outside it)
            cur = base
            for part in rel_path.parts:
                cur = cur / part
                if cur.is_symlink():
                    raise BadInput(f"path {rel[:200]!r} goes through a symbolic link; explore does not "
                                   "follow links")
            inside = path.resolve().is_relative_to(base)
        except OSError as e:  # a name too long for the file system, say
            raise BadInput(f"path {rel[:200]!r} cannot be read ({e.strerror or type(e).__name__})") from None
        if not inside:
            raise BadInput(f"path {rel[:200]!r} leaves the served folder {root!r}")
        return path

    def model(self, key: Any, load: Callable[[], Any]) -> Any:
        """A loaded model from the bounded LRU cache (``load()`` on a miss; one load at a time)."""
        return self.cached(self._models, key, load, self.model_cache_size)

    def cached(self, cache: OrderedDict, key: Any, load: Callable[[], Any], size: int) -> Any:
        """``cache[key]`` of a bounded LRU cache, made by ``load()`` on a miss under ``load_lock``
        (``cache_lock`` is not held meanwhile: the other endpoints' lookups go on)."""
        with self.cache_lock:
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
        with self.load_lock:
            with self.cache_lock:  # another thread may have loaded it while this one waited
                if key in cache:
                    cache.move_to_end(key)
                    return cache[key]
            value = load()
            with self.cache_lock:
                cache[key] = value
                while len(cache) > size:
                    cache.popitem(last=False)
            return value
