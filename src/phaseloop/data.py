"""Data sources, fingerprints, memory-mapped token caches, train/validation windows.

Sources (``--data``):
* a path: one file, or a folder (every regular file under it, sorted, hidden ones skipped);
* ``stdlib``: the running interpreter's standard-library ``.py`` files (built in, no
  download; tests, idlelib, lib2to3 and site-packages left out). Its fingerprint
  changes with the Python version, and every run records it;
* ``shakespeare``: Tiny Shakespeare, found under ``$PHASELOOP_DATA_DIR`` or the cache
  folder, else downloaded from its canonical URL and checked by sha256.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .tokenizer import Tokenizer, get_tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
NAMED_SOURCES = ("stdlib", "shakespeare")


def cache_dir() -> Path:
    d = Path(os.environ.get("PHASELOOP_CACHE", Path.home() / ".cache" / "phaseloop"))
    d.mkdir(parents=True, exist_ok=True)
    return d


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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------- sources
def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = sorted(f for f in root.rglob("*.py")
                   if f.is_file() and not skip & set(f.relative_to(root).parts))
    return root, files


def shakespeare_path(download: bool = True) -> Path:
    candidates = []
    if os.environ.get("PHASELOOP_DATA_DIR"):
        d = Path(os.environ["PHASELOOP_DATA_DIR"])
        candidates += [d / "tinyshakespeare" / "input.txt", d / "input.txt"]
    cached = cache_dir() / "tinyshakespeare" / "input.txt"
    candidates.append(cached)
    for c in candidates:
        if c.is_file():
            return c
    if not download:
        raise DataError("Tiny Shakespeare not found; pass --data /path/to/input.txt")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
            data = r.read()
    except Exception as e:  # offline, DNS, HTTP error
        raise DataError(f"could not download Tiny Shakespeare ({e.__class__.__name__}); pass "
                        "--data /path/to/input.txt, or set PHASELOOP_DATA_DIR to a folder "
                        "holding tinyshakespeare/input.txt") from None
    if hashlib.sha256(data).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError("downloaded Tiny Shakespeare failed its sha256 check; pass --data "
                        "/path/to/input.txt with a verified copy")
    atomic_write_bytes(cached, data)
    return cached


def resolve_source(spec: str | os.PathLike) -> tuple[str, Path, list[Path]]:
    """-> (name, root, files). Raises DataError naming the fix."""
    spec = str(spec)
    if spec == "stdlib":
        root, files = stdlib_files()
        return "stdlib", root, files
    if spec == "shakespeare":
        p = shakespeare_path()
        return "shakespeare", p.parent, [p]
    p = Path(spec).expanduser()
    if not p.exists():
        raise DataError(f"data path {spec!r} does not exist; pass --data with an existing file "
                        f"or folder, or one of: {', '.join(NAMED_SOURCES)}")
    if p.is_file():
        files, root = [p], p.parent
    else:
        root = p
        files = sorted(f for f in p.rglob("*") if f.is_file()
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError as e:
        raise DataError(f"cannot read data {spec!r}: {e.strerror}; check permissions") from None
    if total == 0:
        raise DataError(f"data {spec!r} is empty; pass --data with a non-empty text file or folder")
    return str(p.resolve()), root, files


# ---------------------------------------------------------------------------- corpus
@dataclass
class Corpus:
    name: str
    fingerprint: str  # sha256 of the bytes (one file) or of the file manifest (folder)
    n_files: int
    n_bytes: int
    tokenizer: Tokenizer
    tokens: np.ndarray  # memory-mapped

    def describe(self) -> dict:
        return {"source": self.name, "fingerprint": self.fingerprint, "files": self.n_files,
                "bytes": self.n_bytes, "tokens": int(len(self.tokens)),
                "tokenizer": self.tokenizer.name}

    def split(self, val_fraction: float = 0.1, min_len: int = 2):
        """Deterministic split: the last ``val_fraction`` of tokens is validation."""
        n = len(self.tokens)
        n_val = max(int(n * val_fraction), min_len)
        if n - n_val < min_len:
            raise DataError(f"data {self.name!r} is too small ({n} tokens) for windows of "
                            f"{min_len - 1}; use a larger file or a smaller --seq-len")
        return self.tokens[: n - n_val], self.tokens[n - n_val:]


def _fingerprint(files: list[Path], root: Path) -> str:
    if len(files) == 1:
        return _sha256_file(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{_sha256_file(f)}  {f.relative_to(root).as_posix()}\n".encode())
    return h.hexdigest()


def load_corpus(spec: str | os.PathLike = "stdlib", tokenizer: str | Tokenizer = "bytes") -> Corpus:
    """Resolve, fingerprint and tokenise a source; tokens are cached as a memmap."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    name, root, files = resolve_source(spec)
    try:
        fp = _fingerprint(files, root)
    except OSError as e:
        raise DataError(f"cannot read data {name!r}: {e}; check the path and permissions") from None
    dtype = np.uint8 if tok.vocab_size <= 256 else (np.uint16 if tok.vocab_size <= 65536 else np.uint32)
    path = cache_dir() / "tokens" / f"{fp[:24]}-{tok.name}.{np.dtype(dtype).name}"
    if not path.exists():
        data = b"\n".join(f.read_bytes() for f in files)
        atomic_write_bytes(path, np.asarray(tok.encode(data), dtype=dtype).tobytes())
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return Corpus(name=name, fingerprint=fp, n_files=len(files),
                  n_bytes=sum(f.stat().st_size for f in files), tokenizer=tok, tokens=tokens)


# ---------------------------------------------------------------------------- windows
class TrainBatches:
    """Random contiguous windows; its generator state is the data position, saved in
    checkpoints so a resumed run sees exactly the batches an uninterrupted one would."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(tokens) < seq_len + 1:
            raise DataError(f"training split has {len(tokens)} tokens, fewer than seq_len+1="
                            f"{seq_len + 1}; use more data or a smaller --seq-len")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=self.gen)
        rows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        xy = torch.from_numpy(rows)
        return xy[:, :-1], xy[:, 1:]

    def state(self) -> dict[str, torch.Tensor]:
        return {"generator": self.gen.get_state()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["generator"])


def eval_windows(tokens: np.ndarray, seq_len: int, n_windows: int) -> torch.Tensor:
    """Fixed windows [n, seq_len+1], evenly spaced over the split (deterministic)."""
    if len(tokens) < seq_len + 1:
        raise DataError(f"validation split has {len(tokens)} tokens, fewer than seq_len+1="
                        f"{seq_len + 1}; use more data or a smaller --seq-len")
    last = len(tokens) - seq_len - 1
    n = max(1, min(n_windows, last // seq_len + 1 if last else 1))
    starts = np.linspace(0, last, n).round().astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64))
