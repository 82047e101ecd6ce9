"""Depth at inference through the trunk interface: ``Trunk.set_depth`` on a loaded model
(its FLOPs per token: ``analysis.params.flops_per_token``), and depth sampled in training. UT: steps (ACT: the step
limit; Dehghani et al. 2019 §2.2); Looped / Hyperloop: passes of the shared middle block
(Zeitoun et al., arXiv 2604.21254 §2); a stack has no depth to change."""

from __future__ import annotations

import random
from contextlib import contextmanager

from phaseloop import registry
from phaseloop.config import MAX_DEPTH
from phaseloop.errors import ConfigError
from phaseloop.trunk import Trunk


def set_model_depth(model, depth: int | None, extend: str | None = None) -> None:
    """Run ``model`` (a decoder's trunk, or an encoder-decoder with ``set_depth``) at
    ``depth`` from now on (None: leave it at its trained depth, where ``extend`` has
    nothing to extend); one-line ConfigError where it cannot."""
    if depth is None:
        if extend is not None:
            raise ConfigError("--extend-loops applies with --depth; add --depth K")
        return
    trunk = getattr(model, "trunk", model)
    if not trunk.dynamic_depth:
        tied = ", ".join(s.name for s in registry.all_archs() if s.trunk.dynamic_depth)
        raise ConfigError(f"a {model.cfg.arch} model is a stack of distinct layers: it has no depth "
                          f"to change (--depth applies to weight-tied trunks: {tied})")
    # a plugin trunk written as set_depth(n) (before ``extend``) still works without it
    trunk.set_depth(depth) if extend is None else trunk.set_depth(depth, extend=extend)


def depth_setting(model) -> tuple[int | None, str | None]:
    """The (depth, extend) with which ``set_model_depth`` puts a model where it runs now:
    (None, None) at its trained depth (or without a depth to change); ``extend`` is "last"
    where the depth needs it (a Hyperloop beyond its trained loops)."""
    trunk = getattr(model, "trunk", None)
    if trunk is None or not trunk.dynamic_depth or getattr(trunk, "passes", None) is None \
            or type(trunk).reset_depth is Trunk.reset_depth:  # a plugin trunk that cannot say its depth
        return None, None
    now = trunk.passes
    trunk.reset_depth()
    if trunk.passes == now:
        return None, None
    try:
        set_model_depth(model, now)
        return now, None
    except ConfigError:
        set_model_depth(model, now, "last")
        return now, "last"


# ----------------------------------------------------------------------------- training for depth
def parse_depth_range(text: str) -> tuple[int, int]:
    """``"LO:HI"`` -> (LO, HI): every depth from LO to HI inclusive, 1 <= LO <= HI <=
    config.MAX_DEPTH (``"K"`` alone is ``"K:K"``); ConfigError naming the fix otherwise."""
    parts = str(text).split(":") if isinstance(text, str) else []
    fix = f"write LO:HI with integers 1 <= LO <= HI <= {MAX_DEPTH}, e.g. 2:6 (UT steps / loop passes)"
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError.invalid(f"depth_sample={text!r}: {fix}", "train config")
    lo, hi = int(parts[0]), int(parts[-1])
    if not 1 <= lo <= hi <= MAX_DEPTH:
        raise ConfigError.invalid(f"depth_sample={text!r}: out of range; {fix}", "train config")
    return lo, hi


def sample_depth(depth_range: tuple[int, int], seed: int, step: int) -> int:
    """The depth of training step ``step`` (0-based), uniform over the range: a function of
    (seed, step) only, so it is the same on every rank and a resumed run continues the
    sequence exactly (no RNG state to checkpoint; the global torch RNG is untouched)."""
    lo, hi = depth_range
    return random.Random(f"phaseloop.depth_sample:{seed}:{step}").randint(lo, hi)


def check_depth_sample(model, depth_range: tuple[int, int], extend: str | None = None) -> None:
    """Refuse a range ``model`` cannot train at (a stack; a Hyperloop beyond its trained
    loops without ``extend='last'``) in one line; run it on a meta-device twin."""
    for d in depth_range:  # the ends bound every check set_depth makes
        try:
            set_model_depth(model, d, extend)
            getattr(model, "trunk", model).reset_depth()
        except ConfigError as e:
            raise ConfigError.invalid(f"depth_sample={depth_range[0]}:{depth_range[1]}: "
                              f"{e}", "train config") from None


@contextmanager
def sampled_depth(model, tc, step: int):
    """Run one training step at its sampled depth (``tc.depth_sample``), then return
    ``model`` to its trained depth, at which it is evaluated, saved and decoded."""
    if tc.depth_sample is None:
        yield None
        return
    d = sample_depth(parse_depth_range(tc.depth_sample), tc.seed, step)
    set_model_depth(model, d, tc.extend_loops)
    try:
        yield d
    finally:
        getattr(model, "trunk", model).reset_depth()
