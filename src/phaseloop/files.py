"""Writing files safely: a temporary file in the same folder, then a rename over the
target, so a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from .errors import PhaseloopError


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


def check_name(name, what: str = "--name") -> str:
    """A name that becomes one folder under a registry (a tokenizer's under
    $PHASELOOP_CACHE/tokenizers): letters, digits and ``._+-``, starting with a letter or
    digit, at most 100 characters, so it can never be empty, ``..``, absolute or hold a
    path separator and so never points outside the registry."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PhaseloopError(f"{what} {name!r} is not a plain name: use letters, digits and . _ + -, "
                             "starting with a letter or digit (e.g. bpe-8k); to write elsewhere pass --out DIR")
    return name


def cache_dir() -> Path:
    """$PHASELOOP_CACHE (default ~/.cache/phaseloop): token stores, named tokenizers. Set
    but empty is refused: it would put the cache in the working folder."""
    value = os.environ.get("PHASELOOP_CACHE")
    if value is None:
        return Path.home() / ".cache" / "phaseloop"
    if not value.strip():
        raise PhaseloopError("PHASELOOP_CACHE is set but empty; unset it (the cache is then "
                             "~/.cache/phaseloop) or set it to a folder")
    return Path(value)


def why_missing(path: Path) -> str:
    """Why ``path`` cannot be opened although named: a symlink loop, a broken symlink, or
    it does not exist."""
    path = Path(path)
    try:
        path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop"
        if path.is_symlink():
            return f"is a broken symlink (to {os.readlink(path)})"
        if e.errno == errno.EACCES:
            return "cannot be reached (permission denied)"
        if e.errno == errno.ENOTDIR:
            return "lies under a file, not a folder"
        return "does not exist"
    return "exists"


def check_out_dir(path: Path, what: str = "--out") -> None:
    """Refuse (one line) an output folder that is a file, lies under a file or cannot be
    written, before anything is written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise PhaseloopError(f"{what} {path} is a file, not a folder; choose another {what}")
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise PhaseloopError(f"{what} {path}: {probe} {why_missing(probe)}; choose another {what}")
        probe = probe.parent
    if not probe.is_dir():
        raise PhaseloopError(f"{what} {path} lies under the file {probe}; choose another {what}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PhaseloopError(f"{what} {path}: {probe} is not writable; choose another {what} "
                             "or fix its permissions")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
