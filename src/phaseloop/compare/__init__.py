"""`phaseloop compare`: train model variants over seeds on the same data and budget, then
report losses, speedups and whether each difference from the reference exceeds seed noise.

A *recipe* (TOML or JSON; see ``QUICK_TOML`` and ``recipes/``) names the data, the
variants, the seeds and the budget. A variant is a name plus a spec string::

    BASE[+MODIFIER...] [KEY=VALUE ...]      e.g. "ARCH N=1", "ARCH+MODIFIER d_model=64"

BASE is a registered architecture or one of its aliases (``ArchSpec.aliases``), resolved
to its ``<prefix>-<scale>`` preset, or a preset name. MODIFIERs add overrides (each
architecture's ``ArchSpec.modifiers``; ``registry.modifiers()`` lists them). KEY is a
``ModelConfig`` field or a short name (``KEY_ALIASES``: N, L, D). Everything resolves
lazily, at plan time, so a recipe naming an unregistered architecture fails with one
clear error before anything is trained or written.

The package along its seams: ``recipe`` (recipes, variant specs, a variant's own
training settings), ``budget`` (budget matching on the meta device), ``tune`` (the
``[tune]`` learning-rate grid per variant, on tuning seeds and the tuning slice),
``stats`` (speedups, the paired t-test), ``runs`` (the run descriptions, tuning and
reported, as JSON), ``grid`` (one run executed and watched: its state), ``launch`` /
``worker`` / ``slurm`` (who runs them: this process, local workers, Slurm), ``runner``
(plan, tune, launch, report; --status, --report) and ``report`` (tables, plots,
report.md).

Every (variant, seed) run goes through ``phaseloop.lm.train.train`` into
``OUT/runs/<variant>-s<seed>/``; a finished run (``summary.json``) is skipped and a
half-done one resumed from its last checkpoint. Same seed = same init RNG and the same
data order for every variant, so the noise test pairs runs by seed.
"""

from phaseloop.compare.budget import Planned, match_budget, measure, plan_variants
from phaseloop.compare.grid import format_status, run_state
from phaseloop.compare.launch import LaunchOptions
from phaseloop.compare.recipe import (
    BUILTIN_RECIPES,
    KEY_ALIASES,
    QUICK_TOML,
    Recipe,
    RecipeError,
    Variant,
    apply_overrides,
    load_recipe,
    parse_spec,
    resolve_variant,
    slugify,
)
from phaseloop.compare.report import format_table, summarize, write_report
from phaseloop.compare.runner import (
    comparison_status,
    devices_for,
    main_runs,
    report_finished,
    run_comparison,
    stored_recipe,
)
from phaseloop.compare.runs import CompareRun, tuning_corpus
from phaseloop.compare.stats import first_reach, paired_t_test, speedup, t_two_sided_p
from phaseloop.compare.tune import Tune

__all__ = ["BUILTIN_RECIPES", "KEY_ALIASES", "LaunchOptions", "QUICK_TOML", "Planned", "Recipe",
           "RecipeError", "CompareRun", "Tune", "Variant", "apply_overrides", "comparison_status", "devices_for",
           "first_reach", "format_status", "format_table", "load_recipe", "main_runs", "match_budget", "measure",
           "paired_t_test", "parse_spec", "plan_variants", "report_finished", "resolve_variant", "run_comparison",
           "run_state", "slugify", "speedup", "stored_recipe", "summarize", "t_two_sided_p", "tuning_corpus",
           "write_report"]
