"""What an early exit saves (``early_exit``), counted: the exit statistics of every forward
(``tally``) and the forward FLOPs per token they imply (``exit_flops``, from meta-device
traces). Counted, not measured: a wall-clock figure comes from the benchmarks."""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager

from phaseloop.analysis.params import flops_per_token
from phaseloop.config import ModelConfig
from phaseloop.early_exit import END_READ


class Tally:
    """Sums of ``exit_passes`` / ``exit_readouts`` (and ACT's steps run) over forwards."""

    def __init__(self):
        self.positions = self.passes = self.readouts = self.run = self.loop = 0

    def __call__(self, module, args, out) -> None:
        s = out.stats
        if "exit_passes" not in s:
            return
        n = s["exit_passes"].numel()
        self.positions += n
        self.passes += float(s["exit_passes"].sum())  # ACT: n_updates, a float count
        self.readouts += int(s["exit_readouts"].sum()) if "exit_readouts" in s else 0
        self.loop += int(s.get("exit_loop", 0)) * n  # passes the loop ran (filling the exited ones' keys)
        if "halting_probs" in s:  # ACT: the loop ran this many steps for every position
            self.run += s["halting_probs"].shape[0] * n

    def mean(self, what: str) -> float | None:
        return getattr(self, what) / self.positions if self.positions else None


@contextmanager
def tally(model):
    """Count the exit statistics of every forward of ``model`` inside the block."""
    t = Tally()
    handle = model.register_forward_hook(t)
    try:
        yield t
    finally:
        handle.remove()


@functools.lru_cache(maxsize=16)
def _pass_costs(cfg_json: str, seq_len: int, depth: int, extend: str | None) -> tuple:
    """(F(depth), F(1), one pass) of a config (each a meta-device trace, ``params.flops_per_token``),
    traced once for a sweep's every row rather than per row."""
    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    full = flops_per_token(cfg, seq_len, depth, extend)
    if full is None:
        return None, None, None
    one = flops_per_token(cfg, seq_len, 1, "last")
    return full, one, flops_per_token(cfg, seq_len, 2, "last") - one


def exit_flops(model, seq_len: int, t: Tally | None = None, extend: str | None = None) -> int | None:
    """Forward FLOPs per token at the trunk's depth D (``trunk.passes``) with the exit
    statistics ``t``, from ``params.flops_per_token`` (meta device): F(D) - skipped passes x
    a pass + passes the loop ran past a position's exit x its keys/values (``fill=recompute``;
    ``latest`` projects none) + readouts x (2 d_model V, plus the end block's blocks for
    ``kl`` / ``entropy``: a block costs a pass / ``pass_blocks``). Under ACT F(1) + (steps
    the loop ran - 1) x a step (tensor2tensor keeps transforming a halted position while
    the loop runs; the UT paper, §2.2, copies it). No statistics (no rule, or ``t`` None):
    F(D). Not counted: norms and, in a Hyperloop, the hyper-connections' coefficients of
    an exited position (O(n d_model) each), which every pass still computes. Over-counted
    in a Hyperloop: an end-block readout, at a pass's cost a block, which holds the
    coefficients (and the pooled MLP) the readout does not compute (at hyperloop-tiny,
    batch 1: executed / counted 0.9994 for ``kl``, 0.990 with the pooled MLP)."""
    cfg, trunk = model.cfg, model.trunk
    D = trunk.passes
    full, one, per_pass = _pass_costs(json.dumps(cfg.to_dict(), sort_keys=True), seq_len, D, extend)
    if full is None or t is None or not t.positions:
        return full
    if t.run:
        return round(one + (t.mean("run") - 1) * per_pass)
    exits = trunk.exits
    kv = trunk.pass_blocks * 2 * cfg.d_model * 2 * cfg.n_kv_heads * cfg.head_dim
    if exits is not None and exits.fill == "latest":
        kv = 0
    readout = 2 * cfg.d_model * cfg.vocab_size
    if exits is not None and exits.rule.kind in END_READ:
        readout += trunk.readout_blocks * per_pass / trunk.pass_blocks
    passes = t.mean("passes")
    return round(full - (D - passes) * per_pass + (t.mean("loop") - passes) * kv + t.mean("readouts") * readout)
