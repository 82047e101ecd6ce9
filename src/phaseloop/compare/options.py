"""A recipe's tables of options, checked (what ``recipe``, ``launch`` and ``tune`` share):
``[launcher]`` (``LaunchOptions``: who runs the runs), ``[tune]`` (``Tune``: the
learning-rate grid each variant is tuned over), ``[eval]`` (``EvalOptions``: downstream
tasks on every finished run), and the one error a bad recipe raises."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from dataclasses import dataclass, field

from phaseloop.engine import TrainConfig
from phaseloop.errors import ConfigError, PhaseloopError
from phaseloop.hf import downstream
from phaseloop.validation import MAX_INT, MAX_SEED


class RecipeError(PhaseloopError):
    """A bad comparison recipe, variant, budget or comparison folder (one line)."""


def check_keys(cls, table: dict, where: str, what: str) -> None:
    """Refuse keys that are not fields of ``cls`` (typos), suggesting the closest one."""
    known = [f.name for f in dataclasses.fields(cls)]
    for k in table:
        if k not in known:
            raise RecipeError(f"{where}: unknown {what} {k!r}{suggest(k, known)}; "
                              f"known: {', '.join(known)}")


def suggest(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


LAUNCHERS = ("sequential", "local", "slurm")
EXECUTORS = ("slurm", "local", "debug")  # submitit's: a real cluster, or this machine (tests)
SLURM_KEYS = ("partition", "time", "gpus_per_task", "cpus_per_task", "account", "sbatch", "setup",
              "executor", "array_parallelism", "wait")


@dataclasses.dataclass
class LaunchOptions:
    launcher: str = "sequential"
    jobs: int | None = None  # local: workers at once (default: GPUs / nproc_per_run, or 1 on CPU)
    nproc_per_run: int = 1  # processes (GPUs) per run, under torchrun / Slurm tasks
    partition: str | None = None  # slurm ...
    time: int = 60  # minutes per task (then requeued, resuming from its checkpoint)
    gpus_per_task: int | None = None  # GPUs per array task (= per run)
    cpus_per_task: int | None = None
    account: str | None = None
    sbatch: list = dataclasses.field(default_factory=list)  # extra options, e.g. ["--qos=high"]
    setup: list = dataclasses.field(default_factory=list)  # shell lines before srun (module load ...)
    executor: str = "slurm"  # submitit's slurm, or local / debug on this machine
    array_parallelism: int | None = None  # tasks running at once (default: all)
    wait: bool = False  # slurm: wait for the array, then report (default: submit and return)

    @classmethod
    def resolve(cls, table: dict | None, flags: dict | None = None, where: str = "recipe [launcher]") -> LaunchOptions:
        """The recipe's ``[launcher]`` table with the given command-line ``flags`` on top
        (None values: not given); refuses unknown keys and bad values (one line)."""
        table, flags = dict(table or {}), {k: v for k, v in (flags or {}).items() if v is not None}
        check_keys(cls, table, where, "launcher key")
        o = cls(**{**table, **flags})
        bad = o._problem()
        if bad:
            raise RecipeError(f"{where if bad[0] in table and bad[0] not in flags else 'command line'}: {bad[1]}")
        # the table's keys are checked against the table's own launcher; a --launcher flag that
        # switches it (the same folder resumed elsewhere) leaves the other launcher's keys aside
        defaults = cls()  # a key of the table at its default value changes nothing
        given = [k for k, v in flags.items() if v not in (False, [])] + \
            [k for k, v in table.items() if k not in flags and v != getattr(defaults, k) and "launcher" not in flags]

        def refuse(k: str, launchers: tuple, why: str) -> RecipeError:  # a flag, or a key of the table
            first, rest = launchers[0], "".join(f" or {x}" for x in launchers[1:])
            if k in flags:
                return RecipeError(f"--{k.replace('_', '-')} applies to --launcher {first}{rest}{why}; add "
                                   f"--launcher {first} or drop it")
            return RecipeError(f'{where}: {k} applies to launcher = "{first}"{rest}{why}; add launcher = "{first}" '
                               f"or drop {k}")
        slurm = [k for k in SLURM_KEYS if k in given]
        if o.launcher != "slurm" and slurm:
            raise refuse(slurm[0], ("slurm",), f" (this is {o.launcher})")
        if o.launcher == "sequential" and "nproc_per_run" in given:
            raise refuse("nproc_per_run", ("local", "slurm"), " (a sequential comparison under torchrun spreads "
                         "every run over all its processes)")
        if o.launcher != "local" and "jobs" in given:
            raise refuse("jobs", ("local",), f" (this is {o.launcher}"
                         + ("; Slurm runs one array task per run, --array-parallelism caps how many at once"
                            if o.launcher == "slurm" else "") + ")")
        return o

    def _problem(self) -> tuple[str, str] | None:
        def whole(v, low):
            return isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_INT

        if self.launcher not in LAUNCHERS:
            return "launcher", f"launcher={self.launcher!r}: choose one of {', '.join(LAUNCHERS)}"
        if self.executor not in EXECUTORS:
            return "executor", f"executor={self.executor!r}: choose one of {', '.join(EXECUTORS)}"
        for k, low in (("jobs", 1), ("nproc_per_run", 1), ("time", 1), ("gpus_per_task", 0),
                       ("cpus_per_task", 1), ("array_parallelism", 1)):
            v = getattr(self, k)
            if (v is not None or k in ("nproc_per_run", "time")) and not whole(v, low):
                return k, (f"{k}={v!r}: must be an integer from {low} to {MAX_INT:,}"
                           + (" (minutes)" if k == "time" else ""))
        for k in ("partition", "account"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
                return k, f"{k}={v!r}: must be a Slurm {k} name (no spaces)"
        if not isinstance(self.wait, bool):
            return "wait", f"wait={self.wait!r}: must be true or false"
        for k in ("sbatch", "setup"):
            v = getattr(self, k)
            if not isinstance(v, list) or any(not isinstance(x, str) or not x.strip() for x in v):
                return k, f"{k}={v!r}: must be a list of strings"
        for x in self.sbatch:
            if not x.startswith("--") or len(x) < 3 or any(c.isspace() for c in x.partition("=")[0]):
                return "sbatch", (f"sbatch option {x!r}: write it as sbatch's long option, --KEY=VALUE or "
                                  "--FLAG, e.g. --qos=high or --exclusive")
        if self.gpus_per_task and self.nproc_per_run > 1 and self.gpus_per_task < self.nproc_per_run:
            return "gpus_per_task", (f"gpus_per_task={self.gpus_per_task} for nproc_per_run={self.nproc_per_run}: "
                                     "each process of a run needs its own GPU; ask for at least as many")
        return None

    def sbatch_parameters(self) -> dict:
        """--KEY=VALUE options as submitit's ``additional_parameters`` (True: a bare flag)."""
        out = {}
        for x in self.sbatch:
            k, sep, v = x[2:].partition("=")
            out[k.replace("-", "_")] = v if sep else True
        return out


AXES = ("lr", "warmup_steps", "weight_decay")  # the grid's axes; the rate alone grows at the edges
SHORT = {"lr": "lr", "warmup_steps": "w", "weight_decay": "wd"}
MAX_EXTEND = 10


@dataclass
class Tune:
    lr: list = field(default_factory=list)  # at least 2 distinct rates (sorted)
    seeds: list = field(default_factory=list)  # tuning seeds, none of the recipe's seeds
    warmup_steps: list = field(default_factory=list)  # empty: [train]'s (or the variant's)
    weight_decay: list = field(default_factory=list)
    steps: int | None = None  # a tuning run's steps (default: [train]'s)
    extend: int = 2  # at most this many edge extensions of the rate grid, per variant

    @classmethod
    def parse(cls, recipe) -> Tune:
        """The recipe's [tune] table, checked: one RecipeError naming the key and the fix."""
        d = recipe.tune
        if not isinstance(d, dict):
            raise RecipeError("[tune] must be a table, e.g. [tune] lr = [1e-3, 2e-3, 4e-3] seeds = [100]")
        check_keys(cls, d, "[tune]", "key")
        t = cls(**d)
        if (not isinstance(t.lr, list) or len(t.lr) < 2 or len(set(t.lr)) != len(t.lr)
                or any(not _number(x) or not x > 0 for x in t.lr)):
            raise RecipeError(f"[tune] lr={t.lr!r}: must be a list of at least 2 distinct positive rates, "
                              "e.g. lr = [1e-3, 2e-3, 4e-3]")
        t.lr = sorted(float(x) for x in t.lr)
        if (not isinstance(t.seeds, list) or not t.seeds or len(set(t.seeds)) != len(t.seeds)
                or any(not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED for s in t.seeds)):
            raise RecipeError(f"[tune] seeds={t.seeds!r}: must be a non-empty list of distinct integers, "
                              f"none of the reported seeds {recipe.seeds}, e.g. seeds = [100]")
        shared = sorted(set(t.seeds) & set(recipe.seeds))
        if shared:
            raise RecipeError(f"[tune] seeds {shared} are also reported seeds {recipe.seeds}: tuning on the "
                              f"seeds it reports would bias the comparison; use others, e.g. seeds = "
                              f"[{max(recipe.seeds) + 100}]")
        for k, lo, hi, kind in (("warmup_steps", 0, MAX_INT, int), ("weight_decay", 0, 1, float)):
            xs = getattr(t, k)
            if (not isinstance(xs, list) or len(set(xs)) != len(xs)
                    or any(not (_number(x) if kind is float else isinstance(x, int) and not isinstance(x, bool))
                           or not lo <= x <= hi for x in xs)):
                rng = f"from {lo} to {hi:,}"
                raise RecipeError(f"[tune] {k}={xs!r}: must be a list of distinct {kind.__name__}s {rng}, "
                                  f"e.g. {k} = {[25, 50] if kind is int else [0.0, 0.1]}")
            setattr(t, k, sorted(kind(x) for x in xs))
        for k in ("lr", "weight_decay"):  # a grid point's folder is named by each value to 6 digits
            xs = getattr(t, k)
            same = next(((a, b) for a, b in zip(xs, xs[1:]) if f"{a:g}" == f"{b:g}"), None)
            if same:
                raise RecipeError(f"[tune] {k}: {same[0]!r} and {same[1]!r} agree to 6 significant digits, "
                                  "which name their runs; make them differ there")
        if t.steps is not None and (not isinstance(t.steps, int) or isinstance(t.steps, bool)
                                    or not 1 <= t.steps <= MAX_INT):
            raise RecipeError(f"[tune] steps={t.steps!r}: must be an integer from 1 to {MAX_INT:,} (default: "
                              "[train] steps)")
        if not isinstance(t.extend, int) or isinstance(t.extend, bool) or not 0 <= t.extend <= MAX_EXTEND:
            raise RecipeError(f"[tune] extend={t.extend!r}: must be an integer from 0 to {MAX_EXTEND} "
                              "(edge extensions of the rate grid per variant)")
        for v in recipe.variants:
            both = [k for k in t.axes() if k in v.train]
            if both:
                raise RecipeError(f"variant {v.name!r} sets train.{both[0]} and [tune] tunes {both[0]}; "
                                  "drop one of them")
            for point in t.grid(t.lr):
                try:
                    t.train_config(recipe, v, point, t.seeds[0])
                except ConfigError as e:
                    raise RecipeError(f"[tune] point {point} of variant {v.name!r}: {e}") from None
        return t

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def axes(self) -> list[str]:
        return [k for k in AXES if k == "lr" or getattr(self, k)]

    def grid(self, lrs: list[float]) -> list[dict]:
        """Every point of the grid at rates ``lrs``: {axis: value}, rate-major."""
        values = [lrs] + [getattr(self, k) for k in self.axes()[1:]]
        return [dict(zip(self.axes(), combo)) for combo in itertools.product(*values)]

    def train_config(self, recipe, variant, point: dict, seed: int) -> TrainConfig:
        tc = recipe.train_config(seed, variant, **point)
        return tc.replace(steps=self.steps) if self.steps is not None else tc


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class EvalOptions:
    """A recipe's ``[eval]``: the downstream tasks (``hf.downstream``: hellaswag, piqa, ...)
    scored on every finished run at its trained depth, e.g. ``tasks = ["hellaswag", "piqa"]``,
    ``limit = 500`` (the first documents of each task; default all), ``shots`` (default 0),
    ``batch_size`` (requests per forward pass: speed only)."""
    tasks: list = field(default_factory=list)
    limit: int | None = None
    shots: int = 0
    batch_size: int = 32

    @classmethod
    def parse(cls, table) -> dict:
        """The checked table ({} for none), with every key spelled out."""
        if not isinstance(table, dict):
            raise RecipeError('eval must be a table, e.g. [eval] tasks = ["hellaswag", "piqa"]')
        if not table:
            return {}
        check_keys(cls, table, "recipe [eval]", "key")
        e = cls(**table)
        known = ", ".join(downstream.TASKS)
        if not isinstance(e.tasks, list) or not e.tasks or any(not isinstance(t, str) for t in e.tasks):
            raise RecipeError(f"[eval] tasks = {e.tasks!r}: must be a non-empty list of task names, e.g. "
                              f'["hellaswag", "piqa"] (known: {known})')
        for key, lo in (("limit", 1), ("shots", 0), ("batch_size", 1)):
            v = getattr(e, key)
            if (v is not None or key != "limit") and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise RecipeError(f"[eval] {key} = {v!r}: must be an integer >= {lo}"
                                  + (" (documents per task; leave it out for all)" if key == "limit" else ""))
        try:
            downstream.parse_tasks(e.tasks)
            downstream.check_shots(e.tasks, e.shots)
        except ConfigError as err:
            raise RecipeError(f"recipe [eval]: {err}") from None
        return dataclasses.asdict(e)
