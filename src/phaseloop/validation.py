"""Validation helpers shared by the config dataclasses: errors name the field and the fix."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .errors import ConfigError


def is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def check_ints(obj: Any, names, what: str, minimum: int = 1, optional: bool = False) -> None:
    """Each field must be an integer >= minimum (or None when ``optional``)."""
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not is_int(v, minimum):
            need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(f"invalid {what}: {name}={v!r}: must be {need}"
                              + (" or null" if optional else ""))


def strict_from_dict(cls, d: dict, what: str):
    """Build a dataclass from a dict, refusing unknown keys (typos) by name."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"invalid {what}: unknown field(s) {', '.join(unknown)}; "
                          f"known fields: {', '.join(sorted(known))}")
    return cls(**d)
