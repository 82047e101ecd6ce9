"""Writing files safely: a temporary file in the same folder, then a rename over the
target, so a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import PhaseloopError


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
