"""Writing files safely: a temporary file in the same folder, then a rename over the
target, so a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import tempfile
import time
import tomllib
from pathlib import Path

from phaseloop.errors import CheckpointError, ConfigError, PhaseloopError, first_line

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


def cache_dir(create: bool = False) -> Path:
    """$PHASELOOP_CACHE (default ~/.cache/phaseloop): token stores, named tokenizers,
    downloads, compile records; made first with ``create``. Set but empty is refused: it
    would put the cache in the working folder."""
    value = os.environ.get("PHASELOOP_CACHE")
    if value is not None and not value.strip():
        raise PhaseloopError("PHASELOOP_CACHE is set but empty; unset it (the cache is then "
                             "~/.cache/phaseloop) or set it to a folder")
    d = Path.home() / ".cache" / "phaseloop" if value is None else Path(value)
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


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
    return OSError(errno.EIO, f"{doing} ({first_line(e, 120)})", name)


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None, *, target=None) -> None:
    """safetensors' ``save_file``, its errors as ``OSError`` naming ``target`` (default
    ``path``): every phaseloop writer of weights goes through here or ``writing``."""
    from safetensors.torch import save_file

    with writing(target if target is not None else path):
        save_file(tensors, os.fspath(path), metadata=metadata)


# ---------------------------------------------------------------------------- JSON and digests
def strict(obj):
    """``obj`` with every non-finite float (NaN, ±inf) replaced by None: JSON has no
    NaN, and phaseloop writes strict JSON only."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON (non-finite floats as null)."""
    return json.dumps(strict(obj), allow_nan=False, **kw)


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (dumps(obj, indent=2, sort_keys=True) + "\n").encode())


_SHA256: dict[tuple, str] = {}  # (device, inode, size, mtime_ns, ctime_ns) -> digest, this process only


@contextlib.contextmanager
def read_unchanged(path: Path | None, owner):
    """Around a block that reads ``path`` (a run's weights, for an export): yields a dict whose
    ``sha256`` is the file's digest taken before the block (None: no file; the block refuses
    that itself), and refuses in one line a file whose digest changed meanwhile (a run still
    training overwrote it: the export would record a digest of other weights)."""
    before = {"sha256": sha256_file(path) if path is not None and path.is_file() else None}
    yield before
    if path is not None and (sha256_file(path) if path.is_file() else None) != before["sha256"]:
        raise PhaseloopError(f"{owner}: its checkpoint changed while it was read (training still runs?); "
                             "export again once it stops")


def sha256_file(path: Path) -> str:
    """sha256 of a file (the one digest phaseloop computes of files: checkpoints, corpora,
    tokenizers), read once per process while its inode, size and times stay the same: a
    checkpoint verified again (--init-from's checks, then its load; a hard link
    --keep-checkpoints made) is not read again, and any rewrite of it is. A file changed
    in the last 2 s is always read: file times are coarser than a fast rewrite (git's
    "racy clean" rule)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _SHA256:
        return _SHA256[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > 2_000_000_000:
        if len(_SHA256) > 256:
            _SHA256.clear()
        _SHA256[key] = digest
    return digest


def json_digest(record: dict, without: str) -> str:
    """sha256 of ``record`` less its key ``without`` (where the digest itself is kept), as
    canonical JSON (sorted keys, no spaces): a record that carries its own digest, so one
    damaged or edited after it was written is told (an export's record, a quantised file's
    metadata)."""
    body = {k: v for k, v in record.items() if k != without}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_digests(folder: Path, names) -> dict:
    """{name: {bytes, sha256}} of the files ``names`` in ``folder`` (a checkpoint's manifest,
    an export's phaseloop.json)."""
    return {n: {"bytes": (Path(folder) / n).stat().st_size, "sha256": sha256_file(Path(folder) / n)} for n in names}


def digests_fault(folder: Path, files, names, record: str) -> str | None:
    """What is wrong with the files ``names`` of ``folder`` against ``files`` (a
    ``file_digests`` map read back from ``record``, named in the answer); None when they
    all match."""
    if not isinstance(files, dict) or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int)
                                              and isinstance(f.get("sha256"), str) for f in files.values()):
        return f"its {record} holds no file digests"
    for n in names:
        path, want = Path(folder) / n, files.get(n)
        if want is None:
            return f"its {record} lists no {n}"
        if not path.is_file():
            return f"{n} is missing"
        if path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
            return f"{n} differs from the file written (size or sha256)"
    return None


def read_json(path: Path, fix: str = "restore it or start a new run"):
    """A JSON file's value; one-line ``CheckpointError`` for a missing, unreadable or
    malformed file (``fix``: what to do about a damaged one), or a file where a folder belongs."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; point at a run folder made by `phaseloop train`") from None
    except NotADirectoryError:  # a file given where a folder belongs: nothing is damaged
        file = next(p for p in Path(path).parents if p.exists())
        raise CheckpointError(f"{file} is a file, not a folder; pass the folder that holds it (a run folder "
                              "made by `phaseloop train`, or its checkpoint folder)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e.__class__.__name__}; the file is damaged — {fix}") from None


def read_object(path: Path, what: str = "an object", fix: str = "restore it or start a new run") -> dict:
    """``read_json`` of a file that must hold a JSON object (``what``: how the refusal of
    another value names it)."""
    value = read_json(path, fix)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not {what}: the file is damaged; {fix}")
    return value


def parse_toml(text: str, source: str, error: type[PhaseloopError] = ConfigError) -> dict:
    """The table a TOML text holds (config files, recipes); ``error`` naming ``source``,
    the line and the fix otherwise."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{source} is not valid TOML ({e}); fix that line") from None


def publish_new(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the written ``tmp`` to ``path`` unless something took ``path`` meanwhile (an
    export that runs for minutes checked it was free at the start): a hard link fails on
    an existing name where a rename would overwrite it. ``tmp`` is gone afterwards."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise PhaseloopError(f"{path} appeared while it was being written; it was left alone and nothing was "
                             "written: choose another --out") from None
    except OSError:  # a file system without hard links: rename, if the name is still free
        if os.path.lexists(path):
            raise PhaseloopError(f"{path} appeared while it was being written; it was left alone and nothing "
                                 "was written: choose another --out") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
