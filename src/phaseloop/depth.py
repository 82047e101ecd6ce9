"""Depth at inference (issue 25) through the trunk interface: ``Trunk.set_depth`` on a
loaded model, and the forward FLOPs per token at that depth. UT: steps (ACT: the step
limit; Dehghani et al. 2019 §2.2); Looped / Hyperloop: passes of the shared middle block
(Zeitoun et al., arXiv 2604.21254 §2); a stack has no depth to change."""

from __future__ import annotations

from . import registry
from .config import ModelConfig
from .errors import ConfigError


def set_model_depth(model, depth: int, extend: str | None = None) -> None:
    """Run ``model`` (a decoder's trunk, or an encoder-decoder with ``set_depth``) at
    ``depth`` from now on; one-line ConfigError where it cannot."""
    trunk = getattr(model, "trunk", model)
    if not trunk.dynamic_depth:
        tied = ", ".join(s.name for s in registry.all_archs() if s.trunk.dynamic_depth)
        raise ConfigError(f"a {model.cfg.arch} model is a stack of distinct layers: it has no depth "
                          f"to change (--depth applies to weight-tied trunks: {tied})")
    # a plugin trunk written as set_depth(n) (before ``extend``) still works without it
    trunk.set_depth(depth) if extend is None else trunk.set_depth(depth, extend=extend)


def flops_per_token(cfg: ModelConfig, seq_len: int, depth: int | None = None,
                    extend: str | None = None) -> int | None:
    """Forward FLOPs per token at ``seq_len`` with the trunk at ``depth``
    (``params.measure``: counted on the meta device, where ACT runs every step, an upper
    bound at that step limit); None where the trunk cannot trace on meta."""
    from .params import measure

    return measure(cfg, seq_len, depth, extend)["flops_per_token"]
