"""How many positions a task run needs: sizing ``max_seq_len`` to the examples (and
saying so), or — when the user set it (``--set max_seq_len=N``) — refusing a longer
example before anything trains, naming it and the fix."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from phaseloop.config import ModelConfig
from phaseloop.errors import ConfigError
from phaseloop.tasks.algorithmic import Example
from phaseloop.tasks.task_model import Pair

_FIXED_LEN = "_task_fixed_max_seq_len"  # a plain attribute of a ModelConfig, not a field


def fix_max_seq_len(model_cfg: ModelConfig) -> ModelConfig:
    """Mark ``model_cfg.max_seq_len`` as the user's limit (``--set max_seq_len=N``): a
    task run then refuses a longer example instead of raising max_seq_len to fit it.
    Returns the same config; ``replace()`` drops the mark."""
    setattr(model_cfg, _FIXED_LEN, True)
    return model_cfg


def _pair_positions(pair: Pair, seq2seq: bool) -> int:
    """Positions one example occupies, decoding included: decoder-only ``input + SEP +
    target + EOS``; encoder-decoder the longer of the source and ``BOS + target + EOS``."""
    s, t = pair  # t ends in EOS
    return max(len(s), len(t) + 1) if seq2seq else len(s) + len(t) + 1


def positions_needed(train: Sequence[Example], test: Sequence[Example], tr: Sequence[Pair],
                     te: Sequence[Pair], max_offset: int = 0, seq2seq: bool = False) -> tuple[int, str]:
    """``(positions, description)`` of the example that reaches the furthest position
    (training examples start up to ``max_offset`` positions late, test examples at 0);
    the description names it: split, index, the start of its input, its token counts."""
    n, split, i = max(((_pair_positions(p, seq2seq) + off, split, i)
                       for split, pairs, off in (("train", tr, max_offset), ("test", te, 0))
                       for i, p in enumerate(pairs)), key=lambda c: c[0])  # the first longest
    exs, (s, t) = (train, tr[i]) if split == "train" else (test, te[i])
    ex = exs[i]
    snippet = json.dumps(ex.input if len(ex.input) <= 40 else f"{ex.input[:18]}...{ex.input[-18:]}",
                         ensure_ascii=False)
    counts = (f"source {len(s)}, BOS + target {len(t) - 1} + EOS" if seq2seq
              else f"input {len(s)} + SEP + target {len(t) - 1} + EOS")
    late = f", after a start offset of up to {max_offset}" if split == "train" and max_offset else ""
    return n, (f"{split} example {i + 1} of {len(exs)} (input {snippet}) needs {n} "
               f"positions ({counts}{late})")


def check_positions(model_cfg: ModelConfig, need: int, where: str, hint: str = "",
                    note: Callable[[str], None] | None = None) -> int:
    """The max_seq_len a run with ``need`` positions uses: ``need`` when it exceeds the
    config's value (``note`` says so), unless the user fixed max_seq_len
    (``fix_max_seq_len``): then a ``ConfigError`` names the example and the fix."""
    have = model_cfg.max_seq_len
    if need <= have:
        return have
    if getattr(model_cfg, _FIXED_LEN, False):
        raise ConfigError(f"an example is longer than max_seq_len={have}: the longest, {where}; pass "
                          f"--set max_seq_len={need}{hint}, or drop --set max_seq_len to size it to the examples")
    if note:
        note(f"max_seq_len {have} -> {need} to fit the longest example: {where}")
    return need
