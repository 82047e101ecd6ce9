"""Data sources (``--data``): what documents a corpus holds and its fingerprint. Documents
are streamed as pieces of bytes, so no source is ever read into memory whole.

* a path: a file, or a folder (every regular file under it, sorted, hidden ones skipped).
  By suffix: ``.jsonl`` / ``.parquet`` / ``.arrow`` files hold one document per record
  (the ``text_column``, default ``text``); WikiText's raw files (``wiki.*.raw``,
  ``wiki.*.tokens``) one per article (a `` = Title = `` heading); any other file is one
  document of raw bytes. A folder written by ``datasets.Dataset.save_to_disk`` is read
  with ``datasets.load_from_disk``.
* ``stdlib``: the running interpreter's standard-library ``.py`` files (built in, no
  download; tests, idlelib, lib2to3 and site-packages left out). Its fingerprint changes
  with the Python version, and every run records it.
* ``shakespeare``: Tiny Shakespeare, found under ``$PHASELOOP_DATA_DIR`` or the cache
  folder, else downloaded from its canonical URL and checked by sha256.
* ``hf:NAME[:CONFIG]``: a Hugging Face dataset through ``datasets.load_dataset`` (any
  ``split``; ``streaming`` for big ones), the ``data`` extra. One document per row, except
  WikiText (a dataset whose name says ``wikitext``), whose rows are the raw file's lines:
  they are grouped into articles as the raw files are, and joined with nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sysconfig
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from phaseloop.data.records import records, row_text
from phaseloop.data.tokenizer import CUT_PATTERN
from phaseloop.errors import DataError, first_line
from phaseloop.files import atomic_write_bytes, cache_dir, sha256_file, why_missing

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
NAMED_SOURCES = ("stdlib", "shakespeare", "hf:NAME[:CONFIG]")
RECORD_SUFFIXES = (".jsonl", ".parquet", ".arrow")
BLOCK = 1 << 20  # bytes read at a time from a file
PIECE = 1 << 16  # bytes per piece handed to the tokenizer (a batch holds many)
_CUT = re.compile(CUT_PATTERN)
_WIKITEXT = re.compile(r"^wiki\.(train|valid|test)\.(raw|tokens)$")
_HEADING = re.compile(rb"^ = [^=].* = \r?\n?$")  # a WikiText article title (not = = section = =)


def safe_pieces(stream, split_anywhere: bool) -> Iterator[bytes]:
    """Re-cut a stream of byte blocks into pieces of about ``PIECE`` bytes that a
    chunk-safe tokenizer encodes as the whole: each cut falls at ``tokenizer.CUT_PATTERN``
    (anywhere when ``split_anywhere``, e.g. for bytes). Text without such a place stays in
    one piece (held whole: a document of one long line); it is scanned once, in O(n)."""
    buf, scanned = bytearray(), 0  # scanned: buf[:scanned] holds no cut past the piece's start
    for block in stream:
        buf += block
        start = 0
        while len(buf) - start > PIECE:
            if split_anywhere:
                cut = start + PIECE
            else:
                m = _CUT.search(buf, max(start + PIECE, scanned))
                if m is None:  # a cut needs the 2 bytes after it: the last 2 are looked at again
                    scanned = max(start + PIECE, len(buf) - 2)
                    break
                cut = m.start()
            yield bytes(buf[start:cut])
            start = cut
        del buf[:start]
        scanned = max(0, scanned - start)
    if buf:
        yield bytes(buf)


def _file_blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(BLOCK), b"")


@dataclass
class Source:
    """A resolved ``--data``: ``documents(split_anywhere)`` yields each document as an
    iterator of byte pieces (see ``safe_pieces``)."""

    name: str
    fingerprint: str
    n_files: int
    kind: str  # files | records | wikitext | hf
    files: list[Path] = field(default_factory=list)
    text_column: str | None = None
    dataset: object = None  # datasets.Dataset / IterableDataset for kind 'hf'
    articles: bool = False  # kind 'hf': rows are WikiText lines, grouped into articles

    @property
    def joiner(self) -> bytes:
        """What stands between two documents: a newline, as files are joined; nothing
        between WikiText articles, which are consecutive pieces of one file."""
        return b"" if self.kind == "wikitext" or self.articles else b"\n"

    def describe(self) -> dict:
        d = {"source": self.name, "fingerprint": self.fingerprint, "files": self.n_files}
        if self.kind in ("records", "hf"):
            d["text_column"] = self.text_column
        return d

    def documents(self, split_anywhere: bool = False) -> Iterator[Iterator[bytes]]:
        """Every document, in order. Once they are all read, a source whose documents hold
        no text (none at all, or only whitespace) is refused: every reader (the token store,
        tokenizer training) gets the same check, at no extra pass over the data."""
        seen = {"docs": 0, "bytes": 0, "text": False}

        def watch(doc):
            for piece in doc:
                seen["bytes"] += len(piece)
                if not seen["text"] and piece.strip():
                    seen["text"] = True
                yield piece

        for doc in self._documents(split_anywhere):
            seen["docs"] += 1
            yield watch(doc)
        if not seen["text"]:
            records = self.kind in ("records", "hf")
            what = (f"only whitespace ({seen['bytes']} bytes)" if seen["bytes"] else
                    f"no text: its {seen['docs']} {'records' if records else 'documents'} are all empty"
                    + (" or null" if records else ""))
            raise DataError(f"data {self.name!r} holds {what}; pass --data with text"
                            + (" (or another --text-column)" if records else ""))

    def _documents(self, split_anywhere: bool) -> Iterator[Iterator[bytes]]:
        if self.kind == "hf":
            rows = (row_text(row, self.text_column, f"{self.name}: row {i}").encode("utf-8", "replace")
                    for i, row in enumerate(self.dataset, 1))
            if self.articles:
                yield from _articles(rows, split_anywhere)
                return
            for text in rows:
                yield iter(safe_pieces([text], split_anywhere))
            return
        for f in self.files:
            if f.suffix in RECORD_SUFFIXES:
                for text in records(f, self.text_column):
                    yield safe_pieces([text.encode("utf-8", "replace")], split_anywhere)
            elif _WIKITEXT.match(f.name):
                with open(f, "rb") as lines:
                    yield from _articles(lines, split_anywhere)
            else:
                yield safe_pieces(_file_blocks(f), split_anywhere)


def _articles(lines, split_anywhere: bool) -> Iterator[Iterator[bytes]]:
    """WikiText (a raw file's lines, or a dataset's rows): one document per article, which
    starts at a `` = Title = `` line (the blank line before it belongs to the previous article)."""
    article: list[bytes] = []
    text = False  # the article so far holds more than blank lines
    for line in lines:
        if _HEADING.match(line) and text:
            yield safe_pieces([b"".join(article)], split_anywhere)
            article, text = [], False
        article.append(line)
        text = text or bool(line.strip())
    if article:
        yield safe_pieces([b"".join(article)], split_anywhere)


# ---------------------------------------------------------------------------- resolution
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
    cached = cache_dir(create=True) / "tinyshakespeare" / "input.txt"
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


def _fingerprint(files: list[Path], root: Path, text_column: str) -> str:
    if len(files) == 1:
        fp = sha256_file(files[0])
    else:
        h = hashlib.sha256()
        for f in files:
            # the name's bytes as the file system holds them (a non-UTF-8 name is no traceback)
            h.update(f"{sha256_file(f)}  ".encode() + os.fsencode(f.relative_to(root).as_posix()) + b"\n")
        fp = h.hexdigest()
    if any(f.suffix in RECORD_SUFFIXES for f in files):  # the column read is part of the data
        fp = hashlib.sha256(f"{fp}:{text_column}".encode()).hexdigest()
    return fp


def _refuse_options(spec: str, kind: str, text_column: str, split: str, streaming: bool) -> None:
    """Options that do not apply to a source are refused, not ignored (as ``task`` does):
    ``--text-column`` reads records (.jsonl/.parquet/.arrow, datasets), ``--data-split``
    chooses a split of a dataset, ``--streaming`` streams an ``hf:NAME`` one. Their default
    values (``text``, ``train``, off) are what every source reads, so they always pass:
    a run's config.json and a printed config name them whatever the source."""
    given = []
    if text_column != "text" and kind not in ("records", "hf", "disk"):
        given.append(f"--text-column {text_column}")
    if split != "train" and kind not in ("hf", "disk"):
        given.append(f"--data-split {split}")
    if streaming and kind != "hf":
        given.append("--streaming")
    if given:
        what = {"records": "a file of records", "disk": "a folder saved with save_to_disk",
                "files": "plain text", "wikitext": "WikiText", "named": "a built-in source"}[kind]
        applies = ("--text-column applies to .jsonl/.parquet/.arrow records and datasets, --data-split to "
                   "datasets (hf:NAME or a save_to_disk folder), --streaming to hf:NAME")
        raise DataError(f"{' and '.join(given)} do{'es' if len(given) == 1 else ''} not apply to data "
                        f"{spec!r} ({what}): {applies}; drop {'it' if len(given) == 1 else 'them'}")


def resolve(spec: str | os.PathLike, text_column: str | None = "text", split: str | None = "train",
            streaming: bool = False, strict: bool = True) -> Source:
    """-> Source. Raises DataError naming the fix. ``strict=False`` (reading a trained run's
    data again) lets options that do not apply pass, as earlier versions did when the run
    was trained, so such a run can still be evaluated."""
    spec = str(spec)
    return _resolve(spec, text_column, split, streaming, strict)


def _resolve(spec: str, text_column: str | None, split: str | None, streaming: bool, strict: bool) -> Source:
    refuse = _refuse_options if strict else lambda *a: None
    text_column = "text" if text_column is None else text_column
    split = "train" if split is None else split
    if spec.startswith("hf:"):
        return _hf(spec[3:], text_column, split, streaming)
    if spec in ("stdlib", "shakespeare"):
        refuse(spec, "named", text_column, split, streaming)
    if spec == "stdlib":
        root, files = stdlib_files()
        name = "stdlib"
    elif spec == "shakespeare":
        files = [shakespeare_path()]
        root, name = files[0].parent, "shakespeare"
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            why = why_missing(p)
            raise DataError(f"data path {spec!r} {why}; pass --data with an existing file "
                            f"or folder, or one of: {', '.join(NAMED_SOURCES)}")
        if not p.is_dir() and not p.is_file():
            import stat

            mode = p.stat().st_mode
            what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise DataError(f"data path {spec!r} is {what}, which cannot be read twice (fingerprint, "
                            "then tokens); save its text to a file and pass --data with that file")
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            refuse(spec, "disk", text_column, split, streaming)
            return _hf(str(p), text_column, split, streaming, from_disk=True, strict=strict)
        root = p if p.is_dir() else p.parent
        files = [p] if p.is_file() else sorted(
            f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
        name = str(p.resolve())
    kind = "records" if any(f.suffix in RECORD_SUFFIXES for f in files) else \
        "wikitext" if any(_WIKITEXT.match(f.name) for f in files) else "files"
    if spec not in ("stdlib", "shakespeare"):
        refuse(spec, kind, text_column, split, streaming)
    try:
        total = sum(f.stat().st_size for f in files)
        fp = _fingerprint(files, root, text_column)
    except OSError as e:
        raise DataError(f"cannot read data {spec!r}: {e.strerror}; check the path and permissions") from None
    if total == 0:
        raise DataError(f"data {spec!r} is empty; pass --data with a non-empty text file or folder")
    return Source(name, fp, len(files), kind, files, text_column if kind == "records" else None)


@contextmanager
def _quiet_loggers(*names: str):
    """The named loggers at ERROR while the block runs (their levels restored after)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _hf(spec: str, text_column: str, split: str, streaming: bool, from_disk: bool = False,
        strict: bool = True) -> Source:
    try:
        import datasets
    except ImportError:
        raise DataError("hf: data needs the datasets library: pip install 'phaseloop[data]'") from None
    name, _, config = spec.partition(":") if not from_disk else (spec, "", "")
    try:
        if from_disk:
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{name} has no split {split!r} (splits: {', '.join(ds)}); pass --data-split")
                ds = ds[split]
            elif split != "train" and strict:  # one Dataset: no split to choose (a run trained so: read)
                raise DataError(f"{name} is one dataset, saved without splits; --data-split {split} does not "
                                "apply to it: drop --data-split")
        else:  # the hub's own warnings (its retries offline) are left out: a failure is the one line below
            with _quiet_loggers("huggingface_hub", "datasets"):
                ds = datasets.load_dataset(name, config or None, split=split, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # offline without a cache, unknown dataset or split, ...
        first = first_line(e, 120)
        raise DataError(f"cannot load dataset {spec!r} split {split!r} ({type(e).__name__}: {first}); "
                        "offline, pass --data with a local .txt/.jsonl/.parquet file or a folder "
                        "saved with datasets' save_to_disk") from None
    cols = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    if cols is not None and text_column not in cols:
        raise DataError(f"dataset {spec!r}: no column {text_column!r} (columns: {', '.join(cols)}); "
                        "pass --text-column with one of them")
    if not streaming and len(ds) == 0:
        raise DataError(f"dataset {spec!r} split {split!r} is empty; pass another --data-split")
    fp = getattr(ds, "_fingerprint", None) or hashlib.sha256(
        f"hf:{spec}:{split}:{getattr(ds.info, 'version', '')}:{getattr(ds.info, 'dataset_size', '')}".encode()
    ).hexdigest()
    # WikiText's rows are its lines: grouped into articles (part of the fingerprint, so a
    # store of rows as documents, built before, is not reused)
    info = getattr(ds, "info", None)
    said = [getattr(info, "dataset_name", None), getattr(info, "builder_name", None)]
    articles = "wikitext" in " ".join(map(str, said + ([] if from_disk else [Path(name).name]))).lower()
    fp = hashlib.sha256(f"{fp}:{text_column}{':articles' if articles else ''}".encode()).hexdigest()
    return Source(f"hf:{spec}" + (f"[{split}]" if split != "train" else ""), fp, 0, "hf",
                  text_column=text_column, dataset=ds, articles=articles)
