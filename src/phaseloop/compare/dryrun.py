"""``phaseloop compare RECIPE --dry-run``: check a recipe that is too big to run here.

Every variant is planned as the comparison plans it (budget matching included:
``budget.plan_variants``), built at its full size on the meta device (no weights
allocated) and counted; then each trains a few steps at a shrunk shape (the same architecture and
options, d_model a small multiple of what its heads and phases need, at most 4 layers,
vocabulary 256) on the built-in corpus with bytes, under the recipe's own training
settings (optimiser, decay, schedule, init; the variant's own ones on top). With [tune],
it lists each variant's tuning runs and trains the first of them, shrunk, on the tuning
slice. The paper recipes (``recipes/paper/``) are dry-run in CI so none of them rots.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

from phaseloop.analysis.params import measure
from phaseloop.compare.budget import Planned, plan_variants
from phaseloop.compare.recipe import Recipe
from phaseloop.compare.runs import tuning_corpus
from phaseloop.compare.tune import Tune, tuning_runs
from phaseloop.config import ModelConfig
from phaseloop.data.corpus import load_corpus
from phaseloop.lm.train import train

SHRUNK_TRAIN = dict(steps=2, batch_size=2, grad_accum=1, seq_len=16, warmup_steps=1,
                    eval_every=2, eval_windows=1, ckpt_every=2, log_every=1, device="cpu")


def shrink(cfg: ModelConfig) -> ModelConfig:
    """The same architecture and options at a CPU-test size."""
    d = math.lcm(2 * cfg.n_heads, 2 * cfg.n_phases)  # even head dim, even phase width
    while d < 32:
        d *= 2
    over = dict(d_model=d, d_ff=2 * d, vocab_size=256, max_seq_len=32)
    shrink_arch = cfg.spec.shrink or (lambda c: {"n_layers": min(c.n_layers, 2)})  # ArchSpec.shrink
    return cfg.replace(**{**over, **shrink_arch(cfg)})  # the arch's rule may override the generic one


def dry_run(recipe: Recipe, log=print, data: str = "stdlib") -> list[dict]:
    """Rows {variant, total, without_input_embedding, shrunk_total, val_loss, tuning_runs,
    tuning_val_loss} (see the module)."""

    rows = []
    corpus = load_corpus(data)
    tune = Tune(**recipe.tune) if recipe.tune else None
    plans = plan_variants(recipe)  # matched as the comparison will; every variant refused before any line
    with tempfile.TemporaryDirectory() as tmp:
        for v, cfg, matched in ((p.variant, p.cfg, p.matched) for p in plans):
            full = measure(cfg, min(cfg.max_seq_len, 256))
            small = shrink(cfg)
            tc = dataclasses.replace(recipe.train_config(0, v), **SHRUNK_TRAIN)
            s = train(small, tc, corpus, Path(tmp) / v.slug, progress=False)
            row = {"variant": v.name, "total": full["total"],
                   "without_input_embedding": full["total"] - cfg.vocab_size * cfg.d_model,
                   "shrunk_total": measure(small, 16)["total"], "val_loss": s["val_loss"], "matched": matched}
            if log:
                log(f"{v.name}: {row['total']:,} parameters at full size"
                    + (f" (budget-matched: {', '.join(f'{k} {x}' for k, x in matched.items())})" if matched else "")
                    + " "
                    f"({row['without_input_embedding']:,} without the input embedding); "
                    f"shrunk to {row['shrunk_total']:,}: {tc.steps} steps, val loss {row['val_loss']:.3f}")
            if tune is not None:

                runs = tuning_runs(recipe, tune, Planned(v, cfg, full), tune.lr, Path("OUT"))
                first = dataclasses.replace(runs[0].train, **SHRUNK_TRAIN)
                t = train(small, first, tuning_corpus(corpus, first, first.seq_len), Path(tmp) / "tune" / v.slug,
                          progress=False)
                row.update(tuning_runs=[r.name for r in runs], tuning_val_loss=t["val_loss"])
                if log:
                    log(f"  tuning: {len(runs)} runs of {runs[0].train.steps} steps on the tuning slice "
                        f"(lr {', '.join(f'{x:g}' for x in tune.lr)}"
                        + "".join(f"; {k} {getattr(tune, k)}" for k in tune.axes()[1:])
                        + f"; seeds {tune.seeds}), each edge extension adds {len(runs) // len(tune.lr)} more "
                        f"(at most {tune.extend}): {', '.join(r.name for r in runs)}; the first, shrunk: "
                        f"val loss {t['val_loss']:.3f} on the tuning slice")
            rows.append(row)
    return rows
