"""A step's micro-batches weighted per target token where targets are left out
(``TrainConfig.loss_ignore_id``), so that every split of the global batch (``grad_accum``
micro-batches, ``world`` processes) trains on the loss one batch would: the mean over the
global batch's counted targets, as ``CrossEntropyLoss(ignore_index=pad_id)`` of it.

Each micro-batch's loss is the mean over its own counted targets (``ModelOutput.add_loss``),
so ``1 / grad_accum`` per micro-batch and the mean over processes weight them alike whatever
their counts: a mean of means. Micro-batch i of n_i counted targets, of N over the world,
instead takes ``n_i * world / N`` (the processes' gradients are averaged: x world), and one
with none takes no cross-entropy (its mean was 0 / 0, NaN: the step "diverged"), however
the batch is split: a global batch with no counted target trains on no cross-entropy (its
logged loss 0) and its auxiliary losses alone. Auxiliary losses (ACT's ponder cost) stay a
mean over micro-batches. Where every target counts (no ``loss_ignore_id``) the weights are
the plain ``1 / grad_accum``.
"""

from __future__ import annotations

import torch

from phaseloop.engine import dist
from phaseloop.errors import ConfigError


def ignore_targets(batch, ignore_id: int | None):
    """An (inputs, targets) batch with the targets equal to ``ignore_id`` set to -100, which
    the loss leaves out (``TrainConfig.loss_ignore_id``); None: the batch unchanged."""
    if ignore_id is None:
        return batch
    if not (isinstance(batch, (tuple, list)) and len(batch) in (2, 3)
            and all(isinstance(t, torch.Tensor) for t in batch[:2])):
        raise ConfigError.invalid(f"loss_ignore_id={ignore_id}: applies to the (inputs, "
                          "targets) batches of LM runs, not this run's; drop it (task runs mark "
                          "padding -100 already)", "train config")
    x, y, *rest = batch  # rest: an LM batch's document inputs (data.Documents)
    return (x, y.masked_fill(y == ignore_id, -100), *rest)


def step_batches(batches, tc, world_size: int) -> tuple[list, list[float] | None]:
    """The step's ``grad_accum`` micro-batches (``ignore_targets`` applied) and each one's
    weight ``n_i * world / N``; None where every micro-batch counts ``1 / grad_accum`` (no
    ``loss_ignore_id``: every target counts)."""
    drawn = [ignore_targets(batches.next(), tc.loss_ignore_id) for _ in range(tc.grad_accum)]
    if tc.loss_ignore_id is None:
        return drawn, None
    counts = [int((b[1] != -100).sum()) for b in drawn]  # the batches' CPU targets: no device sync
    total = int(dist.all_sum(float(sum(counts)))[0]) if world_size > 1 else sum(counts)
    return drawn, [n * world_size / max(total, 1) for n in counts]  # one batch in one process: 1 (or 0)


def step_loss(out, weight: float | None, grad_accum: int) -> tuple:
    """(what a micro-batch backpropagates, its cross-entropy's share of the step's logged loss)."""
    if weight is None:
        return out.loss / grad_accum, out.ce_loss.detach() / grad_accum
    # no counted target: a zero term the graph still holds (a process's last micro-batch must backpropagate)
    ce = out.ce_loss * weight if weight else out.logits.sum() * 0.0
    return ce + sum(out.aux_losses.values()) / grad_accum, ce.detach()
