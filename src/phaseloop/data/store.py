"""The token store: a corpus tokenised once into memory-mapped shards.

``build`` streams a source's documents, cuts them into pieces a chunk-safe tokenizer
encodes as the whole (``sources.safe_pieces``), and encodes batches of pieces with the
tokenizer's ``encode_batch`` (the ``tokenizers`` library spreads a batch over every core).
At most ``batch_bytes`` of text are in memory at once, whatever the corpus size.
Documents are joined by the encoding of the source's joiner (a newline: exactly today's
bytes for a folder; nothing between WikiText articles, so the store is the file), or,
built with a separator (``--doc-sep``), by that one token id instead: the last
token of the document before it (the document index points past it, at each document's
first token). The separator is part of the store's identity (its folder name and
manifest), so a store built with one is never read for a run without, nor the reverse.

Layout of ``<cache>/tokens/<source fingerprint>-<tokenizer id>/``: ``tokens-NNNNN.bin``
(uint8 / uint16 / uint32 by vocabulary size), ``docs.i64`` (the start of every document),
``manifest.json`` (source, tokenizer hash, dtype, per-shard token counts and sha256,
documents, bytes, the document index's sha256). The folder is built under a temporary
name and renamed once its manifest is written, so an interrupted build never leaves a
store a later run trusts. Opening a store verifies it (``Store``): sizes always, the
digests and every id against the vocabulary once per state of the files; a damaged store
is refused naming the file and the folder to delete, never rebuilt over or trained on.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from phaseloop.data.sources import Source
from phaseloop.errors import DataError
from phaseloop.files import atomic_write_bytes, cache_dir, pid_alive, sha256_file

FORMAT = "phaseloop.tokens.v2"  # v1: the same without sha256 digests
VERIFIED = "verified.json"


def dtype_for(vocab_size: int):
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def store_dir(source: Source, tok, sep: int | None = None) -> Path:
    """The store's folder: the source's fingerprint, the tokenizer, how the files are cut into
    documents (WikiText's articles by name: the same bytes named otherwise are one document;
    the fingerprint, which a resumed run compares, is of the bytes) and the separator id if any."""
    name = f"{source.fingerprint[:24]}-{tok.sha256[:16] if tok.sha256 else tok.name}"
    name += "-articles" if source.kind == "wikitext" else ""
    return cache_dir(create=True) / "tokens" / (name if sep is None else f"{name}-sep{sep}")


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

    def view(self, a: int, b: int) -> TokenView:
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
    """A built store: its manifest, the tokens (``TokenView``) and the document starts.

    Opening verifies it: every shard's size against the manifest, then (once per state of
    the files) its sha256 against the digest written at build time, the document index,
    and every id against the vocabulary. The files' size, mtime, ctime and inode are then
    kept in ``verified.json``, so later opens of an unchanged store cost a ``stat`` per file;
    any write to a file changes its ctime and brings the full check back. Damage is refused
    by name (never rebuilt over: the folder to delete is named). Stores written before
    digests existed (no ``sha256`` in the manifest) open after the same checks less the
    digest comparison."""

    def __init__(self, path: Path, vocab_size: int | None = None, written: bool = False,
                 sep: int | None = None):
        self.path = path
        try:
            self.manifest = json.loads((path / "manifest.json").read_text())
            fmt = self.manifest.get("format")
            if fmt not in (FORMAT, FORMAT.replace("v2", "v1")):
                raise self._damaged(f"its manifest's format is {fmt!r}, not {FORMAT!r}")
            if not isinstance(self.manifest["shards"], list) or not self.manifest["shards"]:
                raise self._damaged("its manifest lists no shards")
            if fmt == FORMAT and not all(isinstance(sh.get("sha256"), str) for sh in self.manifest["shards"]):
                raise self._damaged("a shard of its manifest has no sha256")
            for key, lo in (("documents", 0), ("tokens", 0), ("bytes", 1)):
                v = self.manifest[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                    raise self._damaged(f"its manifest's {key} is {v!r}")
            dtype = np.dtype(self.manifest["dtype"])
            shards = []
            for sh in self.manifest["shards"]:
                f = path / sh["file"]
                if f.stat().st_size != sh["tokens"] * dtype.itemsize:
                    raise self._damaged(f"{sh['file']} has {f.stat().st_size} bytes, its manifest says "
                                        f"{sh['tokens']} tokens")
                shards.append(np.memmap(f, dtype=dtype, mode="r") if sh["tokens"] else np.zeros(0, dtype))
            if sum(sh["tokens"] for sh in self.manifest["shards"]) != self.manifest["tokens"]:
                raise self._damaged(f"its manifest says {self.manifest['tokens']} tokens, its shards hold "
                                    f"{sum(sh['tokens'] for sh in self.manifest['shards'])}")
            self.docs = np.fromfile(path / "docs.i64", dtype=np.int64)
            self.tokens = TokenView(shards)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise self._damaged(type(e).__name__) from None
        have = self.manifest.get("doc_sep_id")
        if have != sep:  # another separator's store (a renamed folder): never read for this run
            def say(i):
                return "no separator" if i is None else f"separator id {i}"
            raise DataError(f"token store {path} joins documents with {say(have)}, this run with {say(sep)}; "
                            f"delete the folder {path} and run again to rebuild it")
        if len(self.docs) != self.manifest["documents"]:
            raise self._damaged("document index")
        self.vocab_size = vocab_size
        if written:  # this process wrote it: its digests are the bytes just written
            self._stamp(self._stats(), max_id=None)
        else:
            self._verify(shards)

    def _damaged(self, what: str) -> DataError:
        return DataError(f"token store {self.path} is damaged ({what}); delete the folder {self.path} "
                         "and run again to rebuild it")

    def _files(self) -> list[str]:
        return [sh["file"] for sh in self.manifest["shards"]] + ["docs.i64"]

    def _stats(self) -> dict:
        out = {}
        for name in self._files():
            st = (self.path / name).stat()
            out[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        return out

    def _stamp(self, stats: dict, max_id: int | None) -> None:
        try:
            stamp = json.dumps({"files": stats, "max_id": max_id}) + "\n"
            atomic_write_bytes(self.path / VERIFIED, stamp.encode())
        except OSError:  # a read-only cache: the next open checks again
            pass

    def _verify(self, shards: list[np.ndarray]) -> None:
        stats = self._stats()
        try:
            stamp = json.loads((self.path / VERIFIED).read_text())
        except (OSError, ValueError):
            stamp = None
        if isinstance(stamp, dict) and stamp.get("files") == stats and (
                stamp.get("max_id") is None or type(stamp.get("max_id")) is int):  # else: no stamp
            max_id = stamp.get("max_id")
        else:
            # one pass over each shard's bytes (its memmap is the raw file): digest and largest id
            checks = [(sh["file"], sh.get("sha256"), *_digest_and_max(a, sh.get("sha256") is not None))
                      for sh, a in zip(self.manifest["shards"], shards)]
            docs_want = self.manifest.get("docs_sha256")
            if docs_want is not None:
                checks.append(("docs.i64", docs_want, sha256_file(self.path / "docs.i64"), None))
            for name, want, got, _ in checks:
                if want is not None and got != want:
                    raise self._damaged(f"{name} differs from the file written: its sha256 does not match "
                                        "the manifest")
            max_id = max((m for *_, m in checks if m is not None), default=0)
            d = self.docs
            n = len(self.tokens)
            if len(d) and (d[0] != 0 or (np.diff(d) < 0).any() or d[-1] > n):
                raise self._damaged("document index: starts out of order or beyond the tokens")
            self._stamp(stats, max_id)
        if self.vocab_size is not None and max_id is not None and max_id >= self.vocab_size:
            raise self._damaged(f"id {max_id} is beyond the tokenizer's vocabulary of {self.vocab_size}")


def _digest_and_max(a: np.ndarray, digest: bool, step: int = 1 << 24) -> tuple[str | None, int | None]:
    """(sha256 of the array's bytes, or None unless ``digest``; its largest value, None if
    empty) in one chunked pass: for a raw memmap shard these are the file's bytes."""
    h = hashlib.sha256() if digest else None
    top = None
    for i in range(0, len(a), step):
        chunk = np.ascontiguousarray(a[i: i + step])
        if h is not None:
            h.update(memoryview(chunk).cast("B"))
        top = int(chunk.max()) if top is None else max(top, int(chunk.max()))
    return (h.hexdigest() if h is not None else None), top


def build(source: Source, tok, batch_bytes: int = 2 << 20, shard_tokens: int = 1 << 28,
          progress: bool = False, sep: int | None = None, sep_text: str | None = None) -> Store:
    """Tokenise ``source`` into its store (or open the one already built). ``sep``: the
    token id that stands between documents instead of the joiner (``sep_text`` its text,
    recorded in the manifest)."""
    final = store_dir(source, tok, sep)
    if final.exists() or final.is_symlink():  # only a finished build is renamed here: open or refuse it
        return Store(final, tok.vocab_size, sep=sep)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # an interrupted earlier build, not one
        if _abandoned(stale, f".{final.name}.tmp-"):         # another process is writing now
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-{os.getpid()}@{socket.gethostname()}~"))
    try:
        manifest = _write(source, tok, tmp, batch_bytes, shard_tokens, progress, sep)
        if sep is not None:
            manifest.update(doc_sep=sep_text, doc_sep_id=sep)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same store first
            shutil.rmtree(tmp, ignore_errors=True)
            return Store(final, tok.vocab_size, sep=sep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Store(final, tok.vocab_size, written=True, sep=sep)


def _abandoned(folder: Path, prefix: str, day: float = 86400.0) -> bool:
    """A build folder ``PREFIX PID@HOST~*`` whose process is gone (this host), or one older
    than a day (another host's, or a name without them): safe to remove."""
    pid, _, rest = folder.name[len(prefix):].partition("@")
    if rest.split("~", 1)[0] == socket.gethostname() and pid.isdigit():
        return not pid_alive(int(pid))
    try:
        return time.time() - folder.stat().st_mtime > day
    except OSError:
        return False


def _write(source: Source, tok, out: Path, batch_bytes: int, shard_tokens: int, progress: bool,
           sep_id: int | None = None) -> dict:
    dtype = dtype_for(tok.vocab_size)
    if sep_id is not None:
        sep = np.asarray([sep_id], dtype=dtype)
    else:
        sep = tok.encode(source.joiner).astype(dtype) if source.joiner else np.zeros(0, dtype)
    shards: list[dict] = []
    hashes: list = []  # sha256 of each shard, as written
    docs_hash = hashlib.sha256()
    state = {"shard": None, "in_shard": 0, "tokens": 0, "bytes": 0, "docs": 0}
    docs_f = open(out / "docs.i64", "wb")
    bar = None  # made at the first batch encoded, so a refusal before it prints only its line

    def emit(ids: np.ndarray) -> None:
        while len(ids):
            if state["shard"] is None or state["in_shard"] == shard_tokens:
                if state["shard"] is not None:
                    state["shard"].close()
                name = f"tokens-{len(shards):05d}.bin"
                shards.append({"file": name, "tokens": 0})
                hashes.append(hashlib.sha256())
                state["shard"], state["in_shard"] = open(out / name, "wb"), 0
            take = ids[: shard_tokens - state["in_shard"]]
            raw = np.ascontiguousarray(take, dtype=dtype)
            raw.tofile(state["shard"])
            hashes[-1].update(raw)
            shards[-1]["tokens"] += len(take)
            state["in_shard"] += len(take)
            state["tokens"] += len(take)
            ids = ids[len(take):]

    pending: list[bytes] = []  # pieces not yet encoded; None marks a document start
    size = 0

    def flush() -> None:
        nonlocal pending, size, bar
        texts = [p for p in pending if p is not None]
        encoded = iter(tok.encode_batch(texts)) if texts else iter(())
        for p in pending:
            if p is None:  # a document starts here: separator (ending the one before), then its start
                if state["docs"]:
                    emit(sep)
                start = np.asarray([state["tokens"]], dtype=np.int64)
                start.tofile(docs_f)
                docs_hash.update(start)
                state["docs"] += 1
            else:
                ids = next(encoded)
                if len(ids) and int(ids.max()) >= tok.vocab_size:
                    raise DataError(f"tokenizer {tok.name} produced id {int(ids.max())} >= its vocabulary")
                emit(ids)
        if progress and bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="tokenize", dynamic_ncols=True,
                       disable=None)  # no frames where stderr is not a terminal (logs)
        if bar is not None:
            bar.update(size)
        pending, size = [], 0

    ok = False
    try:
        for doc in source.documents(split_anywhere=tok.kind == "bytes"):  # not a tokenizer file named so
            pending.append(None)
            pieces = doc if tok.chunk_safe else [b"".join(doc)]
            for piece in pieces:
                pending.append(piece)
                size += len(piece)
                state["bytes"] += len(piece)
                if size >= batch_bytes:
                    flush()
        flush()
        ok = True
    finally:
        if state["shard"] is not None:
            state["shard"].close()
        docs_f.close()
        if bar is not None:
            bar.leave = ok  # a refusal leaves its one line, not a progress bar
            bar.close()
    if state["tokens"] == 0:
        raise DataError(f"tokenizer {tok.path or tok.name} encoded the {state['bytes']} bytes of data {source.name!r} "
                        "to 0 tokens; pass a tokenizer whose vocabulary covers this text")
    for sh, h in zip(shards, hashes):
        sh["sha256"] = h.hexdigest()
    return {"format": FORMAT, "source": source.describe(), "tokenizer": tok.name,
            "tokenizer_sha256": tok.sha256, "dtype": np.dtype(dtype).name, "shards": shards,
            "tokens": state["tokens"], "documents": state["docs"], "bytes": state["bytes"],
            "docs_sha256": docs_hash.hexdigest()}
