"""``phaseloop train``'s training flags, generated from ``TrainConfig``'s fields (their
help and choices are in the fields' metadata): every field is ``--its-name`` in kebab
case, plus the older spellings in ``ALIASES``."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from phaseloop.cli.argtypes import MAX_SEED, int_in
from phaseloop.engine import TrainConfig
from phaseloop.engine.config import choices
from phaseloop.validation import union_args

# ints bounded above (a step count of 2**70 is a typo, not a run); TrainConfig checks the lower bounds
_TYPES = {int: int_in(None)}  # floats: TrainConfig refuses non-finite ones by field name

# spellings kept from before the flags were generated
ALIASES = {"warmup_steps": ("--warmup",)}


def flags(name: str) -> tuple[str, ...]:
    """The flags of a TrainConfig field, the old spelling first (it names the field in --help)."""
    return (*ALIASES.get(name, ()), "--" + name.replace("_", "-"))


def _base(tp) -> type:
    """int for ``int | None``, and so on."""
    opts = union_args(tp)
    return next(t for t in opts if t is not type(None))


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, default None (= not given: the file, a resumed run
    or the field's default decides); booleans get --no-NAME too."""
    group = parser.add_argument_group("training (TrainConfig fields; a config file's [train])")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        tp = _base(hints[f.name])
        hlp = f.metadata["help"] + ("" if f.default is None else f" (default: {_show(f.default)})")
        kw = {"dest": f.name, "default": None, "help": hlp.replace("%", "%%")}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = int_in(None, MAX_SEED) if f.name == "seed" else _TYPES.get(tp, tp)
            if choices(f.name) is not None:
                kw["choices"] = choices(f.name)
        group.add_argument(*flags(f.name), **kw)


def given(args: argparse.Namespace) -> dict:
    """The TrainConfig fields given on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
            if getattr(args, f.name, None) is not None}
