"""Error types for the task data modules.

They subclass the package's user-facing errors (so the CLI prints them as one line)
and the matching builtin (so callers may also catch ``ValueError`` /
``FileNotFoundError``).
"""

from __future__ import annotations

from phaseloop.errors import DataError


class TaskDataError(DataError, ValueError):
    """Malformed task data (a bad JSONL line, a bad bAbI line); the message names the
    file, the 1-based line number and the fix, in one line."""


class TaskDataNotFound(DataError, FileNotFoundError):
    """A missing data folder or task file; the message says what was looked for."""
