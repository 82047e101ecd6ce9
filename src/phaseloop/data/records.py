"""The records of a .jsonl / .parquet / .arrow file (``sources``' record files): the text
column of each, streamed; a record whose column is not text, a damaged line, batch or page
is refused by file and record, and invalid UTF-8 is replaced (as a raw file's is)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from phaseloop.errors import DataError, first_line


def row_text(row: dict, col: str, where: str) -> str:
    if col not in row:
        raise DataError(f"{where}: no column {col!r} (columns: {', '.join(map(str, row))}); "
                        "pass --text-column with one of them")
    return _as_text(row[col], col, where)


def _as_text(v, col: str, where: str) -> str:
    """A record's text: a string, or null (an empty document). Anything else (a list, an
    object, a number, a boolean) is refused by record rather than read as its Python repr."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    kind = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
            bytes: "bytes"}.get(type(v), type(v).__name__)
    shown = repr(v)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise DataError(f"{where}: {col!r} is {kind} ({shown}), not text; fix the record, or pass "
                    "--text-column with a column of strings")


def records(path: Path, col: str) -> Iterator[str]:
    """The text column of each record of a .jsonl / .parquet / .arrow file, streamed."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{i}: not a JSON object ({e.msg}); fix the line") from None
                    except RecursionError:
                        raise DataError(f"{path}:{i}: not a JSON object this reader takes (nested too "
                                        "deeply); fix the line") from None
                    yield row_text(row if isinstance(row, dict) else {}, col, f"{path}:{i}")
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path.suffix} files needs pyarrow: pip install 'phaseloop[data]'") from None
    try:
        if path.suffix == ".parquet":
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            batches = pf.iter_batches(columns=[col]) if col in names else None
        else:
            with open(path, "rb") as fh:
                head = fh.read(6)
            reader = (pa.ipc.open_file(path) if head == b"ARROW1" else pa.ipc.open_stream(path))
            names = reader.schema.names
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
                if head == b"ARROW1" else iter(reader)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"cannot read {path} ({first_line(e, 80)}); is it a {path.suffix[1:]} file?") from None
    if batches is None or col not in names:
        raise DataError(f"{path}: no column {col!r} (columns: {', '.join(names)}); pass "
                        "--text-column with one of them")
    i = 0
    try:
        for b in batches:
            column = b.column(col)
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                # invalid UTF-8 in a damaged file: replaced, as a .jsonl's is (not a traceback)
                values = [None if v is None else v.decode("utf-8", errors="replace")
                          for v in column.cast(pa.large_binary()).to_pylist()]
            else:
                values = column.to_pylist()
            for v in values:
                i += 1
                yield _as_text(v, col, f"{path}: record {i}")
    except (pa.ArrowException, OSError) as e:  # a damaged page or batch past the header
        raise DataError(f"{path}: record {i + 1} cannot be read ({first_line(e, 80)}); the file is damaged, "
                        "write it again") from None
