"""Validation helpers shared by the config dataclasses: errors name the field and the fix."""

from __future__ import annotations

import difflib
import math
from dataclasses import fields
from typing import Any

from phaseloop.errors import ConfigError

MAX_LAYERS = 1024  # distinct layers built; the deepest published models have a few hundred
MAX_DEPTH = 4096  # layer applications per token (loops included): model.build_model checks it
MAX_SEQ_LEN = 2**24  # positions: a T x T attention score matrix beyond it overflows torch's sizes
MAX_INT = 2**31 - 1  # any integer field: sizes beyond it overflow the kernels' 32-bit (or torch's 64-bit) counts
MAX_SEED = 2**63 - 1  # torch.manual_seed's range (CLI seeds, recipe seeds)


def is_int(v: Any, minimum: int, maximum: int = MAX_INT) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= maximum


def int_limit(obj: Any, name: str) -> int:
    """The largest value an integer field of dataclass ``obj`` takes: its metadata's
    ``max`` (a seed: MAX_SEED), else MAX_INT."""
    f = getattr(type(obj), "__dataclass_fields__", {}).get(name)
    return f.metadata.get("max", MAX_INT) if f is not None else MAX_INT


def too_large(name: str, v: int, limit: int) -> str:
    """The message of an integer beyond ``limit`` in size."""
    said = {MAX_INT: " (2^31 - 1)", MAX_SEED: " (2^63 - 1)"}.get(limit, "")
    return (f"{name}={v!r}: at most {limit:,}{said} in size: larger values overflow the 32-bit sizes of "
            "tensors and kernels (a seed: torch's 64-bit generator); use a smaller value")


def check_ints(obj: Any, names, what: str, minimum: int = 1, optional: bool = False) -> None:
    """Each field must be an integer >= minimum and at most its limit (``int_limit``), or
    None when ``optional``."""
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if is_int(v, minimum, math.inf) and v > int_limit(obj, name):
            raise ConfigError.invalid(too_large(name, v, int_limit(obj, name)), what)
        if not is_int(v, minimum, math.inf):
            need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError.invalid(f"{name}={v!r}: must be {need}" + (" or null" if optional else ""), what)


def strict_from_dict(cls, d: dict, what: str):
    """Build a dataclass from a dict, refusing unknown keys (typos) by name."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError.invalid(f"unknown field(s) {', '.join(unknown)}{hint}; "
                                  f"known fields: {', '.join(sorted(known))}", what)
    return cls(**d)


_ABSENT = object()


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first place two JSON-like values differ, as (dotted path, a's, b's), or None:
    names the one key that changed instead of showing two whole dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            d = first_difference(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if a == b and isinstance(a, bool) == isinstance(b, bool):
        return None
    show = lambda v: "(absent)" if v is _ABSENT else repr(v)
    return path, show(a), show(b)


def union_args(tp) -> tuple:
    """The types of an annotation: the members of ``int | None`` and of ``typing.Optional[int]``
    / ``Union[...]`` (not a ``types.UnionType``) alike, else ``(tp,)``."""
    import types
    import typing

    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def check_types(obj: Any, what: str) -> None:
    """Every field holds its annotated type (``int``, ``float`` (an int will do, finite),
    ``bool``, ``str``, ``... | None``), an integer at most its limit in size
    (``int_limit``: MAX_INT unless the field's metadata says otherwise);
    ``object``/``list``/``dict`` fields are the caller's. Runs before any field is used,
    so a wrong type is one ConfigError."""
    import typing

    for name, tp in typing.get_type_hints(type(obj)).items():
        if name.startswith("_"):
            continue
        v = getattr(obj, name)
        opts = union_args(tp)
        if v is None and type(None) in opts:
            continue
        base = next((t for t in opts if t is not type(None)), None)
        if base is bool:
            ok = isinstance(v, bool)
        elif base is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif base is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif base is str:
            ok = isinstance(v, str)
        else:
            continue
        if ok and base is int and abs(v) > int_limit(obj, name):
            raise ConfigError.invalid(too_large(name, v, int_limit(obj, name)), what)
        if not ok:
            kind = {bool: "true or false", int: "an integer", float: "a finite number",
                    str: "a string"}[base]
            raise ConfigError.invalid(f"{name}={v!r}: must be {kind}" + (" or null" if type(None) in opts else ""),
                                      what)
