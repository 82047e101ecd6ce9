"""Load a user's JSONL file of ``{"input": ..., "target": ...}`` objects.

One JSON object per line, with string values ``"input"`` and ``"target"``; an optional
integer ``"length"`` (>= 0) sets ``Example.length`` (default: the number of characters
of ``input``). Other keys are ignored. Blank lines are skipped. The file is UTF-8.

Every problem raises one ``ValueError`` (``TaskDataError``) whose one-line message is
``"<file>:<line>: <problem>; <fix>"`` with the 1-based line number: bad JSON, a value
that is not an object, a missing key, a non-string value, bad UTF-8, or an empty file or
one whose strings are all empty (reported at line 1). A missing file raises
``FileNotFoundError`` (``TaskDataNotFound``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from phaseloop.data.tokenizer import EOS
from phaseloop.files import why_missing
from phaseloop.tasks._errors import TaskDataError, TaskDataNotFound
from phaseloop.tasks.algorithmic import Example

REQUIRED_KEYS = ("input", "target")
_SHAPE = 'one JSON object per line, like {"input": "abc", "target": "cba"}'


def _short(value: object, limit: int = 40) -> str:
    r = json.dumps(value, ensure_ascii=False)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {list: "array", dict: "object", str: "string"}.get(type(value), type(value).__name__)


def load_jsonl(path: str | os.PathLike) -> list[Example]:
    """Read examples from ``path`` (see module doc for the format and the errors)."""
    if not os.fspath(path).strip():  # Path("") would be "." (a folder)
        raise TaskDataNotFound(f"empty path; pass the path of a .jsonl file ({_SHAPE})")
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else why_missing(p)
        raise TaskDataNotFound(f"{p}: {what}; pass the path of a .jsonl file ({_SHAPE})")
    examples: list[Example] = []
    with open(p, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskDataError(
                    f"{where}: not valid UTF-8 (byte {e.start + 1} of the line); save the file as UTF-8"
                ) from None
            if lineno == 1:
                line = line.lstrip("\ufeff")  # tolerate a UTF-8 byte-order mark
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))  # its own line: the column within it, not on "line 2"
            except json.JSONDecodeError as e:
                raise TaskDataError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno}); write {_SHAPE}"
                ) from None
            if not isinstance(obj, dict):
                raise TaskDataError(
                    f"{where}: expected a JSON object, got {_json_type(obj)} {_short(obj)}; write {_SHAPE}"
                )
            for key in REQUIRED_KEYS:
                if key not in obj:
                    raise TaskDataError(
                        f"{where}: missing key {key!r}; add \"{key}\": \"...\" to the object ({_SHAPE})"
                    )
                if not isinstance(obj[key], str):
                    raise TaskDataError(
                        f"{where}: {key!r} must be a string, got {_json_type(obj[key])} "
                        f"{_short(obj[key])}; write it as a JSON string in double quotes, e.g. \"{key}\": \"123\""
                    )
            length = obj.get("length", len(obj["input"]))
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise TaskDataError(
                    f"{where}: 'length' must be an integer >= 0, got {_short(length)}; fix it or remove the key"
                )
            examples.append(Example(obj["input"], obj["target"], length))
    if not examples:
        raise TaskDataError(
            f"{p}:1: file has no examples (it is empty or only blank lines); write {_SHAPE}"
        )
    if not any(ex.input or ex.target for ex in examples):
        raise TaskDataError(
            f"{p}:1: every 'input' and 'target' is an empty string ({len(examples)} examples), so there "
            f"is nothing to learn; write text in them ({_SHAPE})"
        )
    return examples


def save_jsonl(path: str | os.PathLike, examples: Iterable[Example]) -> int:
    """Write examples as JSONL (``input``, ``target``, ``length``); returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(
                json.dumps({"input": ex.input, "target": ex.target, "length": ex.length}, ensure_ascii=False)
                + "\n"
            )
            n += 1
    return n


__all__ = ["load_jsonl", "save_jsonl"]


class TokenizerVocab:
    """A corpus tokenizer (``phaseloop.data.tokenizer``) as a task vocabulary: its ids shifted
    past the task specials (PAD 0, EOS 1, SEP 2), for JSONL tasks in a learned vocabulary."""

    SPECIALS = ("<pad>", "<eos>", "<sep>")

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __len__(self) -> int:
        return len(self.SPECIALS) + self.tok.vocab_size

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        ids = [int(i) + len(self.SPECIALS) for i in self.tok.encode(text)]
        return ids + [EOS] if add_eos else ids

    def decode(self, ids) -> str:
        out = []
        for i in (ids.tolist() if hasattr(ids, "tolist") else ids):
            if i == EOS:
                break
            if i >= len(self.SPECIALS):
                out.append(i - len(self.SPECIALS))
        return self.tok.decode(out)
