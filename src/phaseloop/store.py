"""The token store: a corpus tokenised once into memory-mapped shards.

``build`` streams a source's documents, cuts them into pieces a chunk-safe tokenizer
encodes as the whole (``sources.safe_pieces``), and encodes batches of pieces with the
tokenizer's ``encode_batch`` (the ``tokenizers`` library spreads a batch over every core).
At most ``batch_bytes`` of text are in memory at once, whatever the corpus size.
Documents are joined by the encoding of the source's joiner (a newline: exactly today's
bytes for a folder; nothing between WikiText articles, so the store is the file).

Layout of ``<cache>/tokens/<source fingerprint>-<tokenizer id>/``: ``tokens-NNNNN.bin``
(uint8 / uint16 / uint32 by vocabulary size), ``docs.i64`` (the start of every document),
``manifest.json`` (source, tokenizer hash, dtype, per-shard token counts, documents,
bytes). The folder is built under a temporary name and renamed once its manifest is
written, so an interrupted build never leaves a store a later run trusts; a store whose
shards do not match their manifest is refused.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import DataError
from .sources import Source, cache_dir

FORMAT = "phaseloop.tokens.v1"


def dtype_for(vocab_size: int):
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def store_dir(source: Source, tok) -> Path:
    return cache_dir() / "tokens" / f"{source.fingerprint[:24]}-{tok.sha256[:16] if tok.sha256 else tok.name}"


class TokenView:
    """The tokens [start, end) of a store's shards as one sequence: ``len`` and slicing
    (``view[a:b]`` -> ndarray, across shard boundaries), as a single memmap would."""

    def __init__(self, shards: list[np.ndarray], start: int = 0, end: int | None = None):
        self.shards = shards
        self.offsets = [0]
        for s in shards:
            self.offsets.append(self.offsets[-1] + len(s))
        self.start, self.end = start, self.offsets[-1] if end is None else end
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return self.end - self.start

    def view(self, a: int, b: int) -> "TokenView":
        return TokenView(self.shards, self.start + a, self.start + b)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            key = int(key) + (len(self) if key < 0 else 0)
            return self[key: key + 1][0]
        a, b, step = key.indices(len(self))
        if b <= a:
            return np.zeros(0, dtype=self.dtype)
        a, b = self.start + a, self.start + b
        out, i = [], bisect.bisect_right(self.offsets, a) - 1
        while a < b:
            lo = self.offsets[i]
            take = min(b, self.offsets[i + 1]) - a
            out.append(self.shards[i][a - lo: a - lo + take])
            a += take
            i += 1
        arr = np.concatenate(out) if len(out) != 1 else np.asarray(out[0])
        return arr[::step] if step != 1 else arr

    def __array__(self, dtype=None, copy=None):
        arr = self[:]
        return arr.astype(dtype) if dtype is not None else arr


class Store:
    """A built store: its manifest, the tokens (``TokenView``) and the document starts."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.manifest = json.loads((path / "manifest.json").read_text())
            dtype = np.dtype(self.manifest["dtype"])
            shards = []
            for sh in self.manifest["shards"]:
                f = path / sh["file"]
                if f.stat().st_size != sh["tokens"] * dtype.itemsize:
                    raise DataError(f"token store {path} is damaged ({sh['file']} has "
                                    f"{f.stat().st_size} bytes, its manifest says {sh['tokens']} tokens); "
                                    "delete the folder and run again to rebuild it")
                shards.append(np.memmap(f, dtype=dtype, mode="r") if sh["tokens"] else np.zeros(0, dtype))
            self.docs = np.fromfile(path / "docs.i64", dtype=np.int64)
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"token store {path} is damaged ({type(e).__name__}); delete the folder "
                            "and run again to rebuild it") from None
        if len(self.docs) != self.manifest["documents"]:
            raise DataError(f"token store {path} is damaged (document index); delete the folder and "
                            "run again to rebuild it")
        self.tokens = TokenView(shards)


def build(source: Source, tok, batch_bytes: int = 2 << 20, shard_tokens: int = 1 << 28,
          progress: bool = False) -> Store:
    """Tokenise ``source`` into its store (or open the one already built)."""
    final = store_dir(source, tok)
    if (final / "manifest.json").exists():
        return Store(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # an interrupted earlier build
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        manifest = _write(source, tok, tmp, batch_bytes, shard_tokens, progress)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same store first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Store(final)


def _write(source: Source, tok, out: Path, batch_bytes: int, shard_tokens: int, progress: bool) -> dict:
    dtype = dtype_for(tok.vocab_size)
    sep = tok.encode(source.joiner).astype(dtype) if source.joiner else np.zeros(0, dtype)
    shards: list[dict] = []
    state = {"shard": None, "in_shard": 0, "tokens": 0, "bytes": 0, "docs": 0}
    docs_f = open(out / "docs.i64", "wb")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="tokenize", dynamic_ncols=True)

    def emit(ids: np.ndarray) -> None:
        while len(ids):
            if state["shard"] is None or state["in_shard"] == shard_tokens:
                if state["shard"] is not None:
                    state["shard"].close()
                name = f"tokens-{len(shards):05d}.bin"
                shards.append({"file": name, "tokens": 0})
                state["shard"], state["in_shard"] = open(out / name, "wb"), 0
            take = ids[: shard_tokens - state["in_shard"]]
            take.astype(dtype, copy=False).tofile(state["shard"])
            shards[-1]["tokens"] += len(take)
            state["in_shard"] += len(take)
            state["tokens"] += len(take)
            ids = ids[len(take):]

    pending: list[bytes] = []  # pieces not yet encoded; None marks a document start
    size = 0

    def flush() -> None:
        nonlocal pending, size
        texts = [p for p in pending if p is not None]
        encoded = iter(tok.encode_batch(texts)) if texts else iter(())
        for p in pending:
            if p is None:  # a document starts here: separator, then record its start
                if state["docs"]:
                    emit(sep)
                np.asarray([state["tokens"]], dtype=np.int64).tofile(docs_f)
                state["docs"] += 1
            else:
                ids = next(encoded)
                if len(ids) and int(ids.max()) >= tok.vocab_size:
                    raise DataError(f"tokenizer {tok.name} produced id {int(ids.max())} >= its vocabulary")
                emit(ids)
        if bar is not None:
            bar.update(size)
        pending, size = [], 0

    try:
        for doc in source.documents(split_anywhere=tok.name == "bytes"):
            pending.append(None)
            pieces = doc if tok.chunk_safe else [b"".join(doc)]
            for piece in pieces:
                pending.append(piece)
                size += len(piece)
                state["bytes"] += len(piece)
                if size >= batch_bytes:
                    flush()
        flush()
    finally:
        if state["shard"] is not None:
            state["shard"].close()
        docs_f.close()
        if bar is not None:
            bar.close()
    if state["tokens"] == 0:
        raise DataError(f"data {source.name!r} holds no text (0 tokens); pass --data with a non-empty "
                        "source, or another --data-split / --text-column")
    return {"format": FORMAT, "source": source.describe(), "tokenizer": tok.name,
            "tokenizer_sha256": tok.sha256, "dtype": np.dtype(dtype).name, "shards": shards,
            "tokens": state["tokens"], "documents": state["docs"], "bytes": state["bytes"]}
