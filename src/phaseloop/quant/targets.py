"""Which Linear layers are quantised: all but the embedding and head by default;
weights shared with a module that is not a target are left alone."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch.nn as nn

from phaseloop.errors import ConfigError


def default_skip(name: str, module: nn.Module) -> bool:
    """Default: keep embeddings and the output head in full precision (names containing 'embed' or 'head')."""
    low = name.lower()
    return "embed" in low or "head" in low


def _make_skip(skip) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        skip = (skip,)
    subs = tuple(s.lower() for s in skip)
    return lambda name, module: any(s in name.lower() for s in subs)


def select_linears(model: nn.Module, modules=None, skip=default_skip):
    """Ordered {name: Linear} of the targets, plus names skipped because their weight is shared
    with a module that is not a target (e.g. a head tied to the embedding)."""
    if modules is None:
        pred = _make_skip(skip)
        cand = OrderedDict((n, m) for n, m in model.named_modules()
                           if isinstance(m, nn.Linear) and not pred(n, m))
    elif isinstance(modules, Mapping):
        cand = OrderedDict(modules.items())
    else:
        named = dict(model.named_modules())
        cand = OrderedDict()
        for item in modules:
            if isinstance(item, str):
                if item not in named:
                    raise ConfigError(f"modules: no submodule named {item!r} in the model")
                cand[item] = named[item]
            else:
                nm = next((n for n, m in named.items() if m is item), None)
                if nm is None:
                    raise ConfigError("modules: a given module is not part of the model")
                cand[nm] = item
    for n, m in cand.items():
        if not isinstance(m, nn.Linear):
            raise ConfigError(f"modules: {n!r} is a {type(m).__name__}, only nn.Linear can be quantised")
    target_ids = {id(m) for m in cand.values()}
    other_params = set()
    for m in model.modules():
        if id(m) not in target_ids:
            other_params.update(id(p) for p in m.parameters(recurse=False))
    shared = [n for n, m in cand.items() if id(m.weight) in other_params]
    for n in shared:
        del cand[n]
    return cand, shared
