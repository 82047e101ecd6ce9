"""Depth at inference (issue 25) through the trunk interface: ``Trunk.set_depth`` on a
loaded model, and the forward FLOPs per token at that depth. UT: steps (ACT: the step
limit; Dehghani et al. 2019 §2.2); Looped / Hyperloop: passes of the shared middle block
(Zeitoun et al., arXiv 2604.21254 §2); a stack has no depth to change."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from .config import ModelConfig
from .errors import ConfigError
from .model import build_model


def set_model_depth(model, depth: int, extend: str | None = None) -> None:
    """Run ``model`` (a decoder's trunk, or an encoder-decoder with ``set_depth``) at
    ``depth`` from now on; one-line ConfigError where it cannot."""
    trunk = getattr(model, "trunk", model)
    if not getattr(trunk, "dynamic_depth", False):
        raise ConfigError(f"a {model.cfg.arch} model is a stack of distinct layers: it has no depth "
                          "to change (--depth applies to weight-tied trunks: universal, looped, hyperloop)")
    # a plugin trunk written as set_depth(n) (before ``extend``) still works without it
    trunk.set_depth(depth) if extend is None else trunk.set_depth(depth, extend=extend)


def flops_per_token(cfg: ModelConfig, seq_len: int, depth: int | None = None,
                    extend: str | None = None) -> int | None:
    """Forward FLOPs per token at ``seq_len`` (params.count_params' convention) with the
    trunk at ``depth``, counted on the meta device (ACT runs every step there: an upper
    bound at that step limit); None where the trunk cannot trace on meta."""
    model = build_model(cfg, device="meta")
    if depth is not None:
        set_model_depth(model, depth, extend)
    idx = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(idx)
    except Exception:  # noqa: BLE001 - a plugin trunk with data-dependent control flow
        return None
    return int(fc.get_total_flops() // seq_len)
