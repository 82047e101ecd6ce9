"""Writing files safely: a temporary file in the same folder, then a rename over the
target, so a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def writing(target: Path):
    """Turn a write error that is not an ``OSError`` into one naming ``target``: safetensors
    reports a full disk or a failed write as its own ``SafetensorError`` ("I/O error: No
    space left on device (os error 28)"), which the command line then reports as it does
    every file-system error (one line, exit 2). ``target`` is the file the user asked
    for, not the temporary file being written."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise as_os_error(e, target) from None


def as_os_error(e: BaseException, target, doing: str = "could not be written") -> OSError:
    """An ``OSError`` for ``e`` (a SafetensorError) with the errno its text names, else
    EIO and ``doing`` with safetensors' words."""
    name = None if target is None else os.fspath(target)
    m = re.search(r"os error (\d+)", str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), name)
    return OSError(errno.EIO, f"{doing} ({str(e)[:120]})", name)


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None, *, target=None) -> None:
    """safetensors' ``save_file``, its errors as ``OSError`` naming ``target`` (default
    ``path``): every phaseloop writer of weights goes through here or ``writing``."""
    from safetensors.torch import save_file

    with writing(target if target is not None else path):
        save_file(tensors, os.fspath(path), metadata=metadata)
