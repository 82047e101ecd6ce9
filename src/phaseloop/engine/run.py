"""A run folder: what was run (config.json), what happened (metrics.jsonl), where it got
to (checkpoint/) and how it ended (summary.json). Every write is a temporary file or
folder renamed into place; a folder holding another run is never touched."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import CKPT, MANIFEST, TMP_PREFIX, checkpoint_dir, read_run_config, remove_orphans
from phaseloop.engine.config import TrainConfig
from phaseloop.errors import CheckpointError, PhaseloopError
from phaseloop.files import atomic_write_bytes, check_out_dir, dumps, read_json, read_object, write_json

# keys that may change between a run and its resumption (where it runs, not what; and
# the budget of skipped non-finite steps, so a diverged run can be resumed with one)
RESUMABLE_CHANGES = ("device", "compile", "skip_nonfinite", "parallel", "checkpoint_activations", "peak_tflops",
                     "batch_size", "grad_accum",  # these two as long as the global batch holds
                     "log_to", "keep_checkpoints", "keep_best")  # what is mirrored and kept


def _global_batch(cfg: dict) -> int | None:
    """batch_size x grad_accum x world size of a run config (world: its ``parallel``
    section, 1 when absent)."""
    train = cfg.get("train", {})
    if "batch_size" not in train:
        return None
    return train["batch_size"] * train.get("grad_accum", 1) * cfg.get("parallel", {}).get("world_size", 1)


def _normalised(section: str, saved: dict) -> dict:
    """A saved section as this version writes it: a field added later is absent from an
    older run's config.json and means its default (the old behaviour), and a model config
    is rebuilt (an older version wrote every architecture's fields)."""

    if section == "model":
        try:
            return ModelConfig.from_dict(saved).to_dict()
        except PhaseloopError:
            return saved  # compared as it is: the first difference names the field
    if section == "train":
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                    if f.default is not dataclasses.MISSING}
        return {**defaults, **saved}
    return saved


def _first_difference(saved: dict, want: dict, section: str) -> str | None:
    if section == "data":  # the same bytes and the same tokenizer, however they were named
        keys = ("fingerprint", "tokenizer_sha256", "doc_sep")
        return next((k for k in keys if saved.get(k) != want.get(k) and (k in saved or want.get(k))), None)
    saved = {k: v for k, v in _normalised(section, saved).items() if k in want or k in saved}
    keys = sorted(set(saved) | set(want), key=str)
    return next((k for k in keys if saved.get(k) != want.get(k) and k not in RESUMABLE_CHANGES), None)


def _records(path: Path) -> tuple[list[str], list[dict], bool]:
    """(lines, records, open_end): a last line cut short by a kill is dropped, and a last
    line without its newline (a kill between the record and it) must be ended before the
    next record is appended (``open_end`` either way); a bad line before it is damage,
    refused by line number."""
    try:
        text = path.read_text() if path.exists() else ""
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text: the file is damaged; restore it to resume") from None
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                return lines[:-1], records, True  # torn
            raise CheckpointError(f"{path} line {i + 1} is not valid JSON: the file is damaged; "
                                  "restore it, or delete that line to resume") from None
        if not isinstance(records[-1], dict):
            raise CheckpointError(f"{path} line {i + 1} is not a metrics record; restore the file, "
                                  "or delete that line to resume")
        step = records[-1].get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # every record has its step
            raise CheckpointError(f"{path} line {i + 1} has no step number (\"step\": {step!r}, a whole number "
                                  "every record holds): the file is damaged; restore it, or delete that line "
                                  "to resume")
    return lines, records, bool(text) and not text.endswith("\n")


def _expected(every, steps: int, step: int) -> list[int]:
    """The steps ``k <= step`` a record is logged at: every ``every`` steps and the last."""
    return list(range(every, step + 1, every)) + ([steps] if steps <= step and steps % every else [])


def check_records(path: Path, records: list[dict], step: int, train: dict) -> None:
    """The records of metrics.jsonl up to the checkpoint's ``step`` must all be there: a
    record is appended before the checkpoint of its step is written, so a kill can only
    lose (tear) records after it. A missing, repeated or misplaced record up to ``step``
    is damage, refused by step before anything is changed. Training records (those with
    ``lr``) come every ``log_every`` steps and at the last; evaluation records, where the
    run logs any, every ``eval_every`` steps and at the last."""
    steps = train.get("steps")
    if not (isinstance(steps, int) and isinstance(step, int)):
        return
    fix = ("the file is damaged and resuming would lose those records; restore it from a copy, or start "
           "the run again in another --out (nothing was changed)")
    upto = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
    evals = [r for r in upto if "lr" not in r]
    for kind, every, have in (("training", train.get("log_every"), [r for r in upto if "lr" in r]),
                              ("evaluation", train.get("eval_every"), evals if evals else None)):
        if have is None or not (isinstance(every, int) and every > 0):
            continue
        want, got = _expected(every, steps, step), [r["step"] for r in have]
        if got == want:
            continue
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if not path.exists():
            raise CheckpointError(f"{path} is missing, and the checkpoint of step {step} was written after "
                                  f"{len(want)} {kind} records; restore it from a copy, or start the run again "
                                  "in another --out (nothing was changed)")
        if i < len(want) and (i >= len(got) or got[i] > want[i]):
            raise CheckpointError(f"{path} lacks the {kind} record of step {want[i]}, before the checkpoint of "
                                  f"step {step} ({len(got)} of its {len(want)} {kind} records are there); {fix}")
        article = "an" if kind == "evaluation" else "a"
        raise CheckpointError(f"{path} holds {article} {kind} record of step {got[i]} out of place (a repeated "
                              f"or misplaced line), before the checkpoint of step {step}; {fix}")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (none if it has none yet)."""
    return _records(Path(run_dir) / "metrics.jsonl")[1]


class RunFolder:
    """The folder of one training run. ``open`` checks it before anything is written:
    a new run needs an absent or empty folder; ``resume=True`` needs the same settings
    (every section of ``run_cfg`` but ``software``), or starts the run when the folder
    holds none yet (so "rerun with --resume until done" works for preemptible jobs);
    ``start`` then removes what interrupted writes left, writes config.json (new runs)
    and drops metric records past the step resumed from."""

    def __init__(self, path: str | Path, run_cfg: dict, resuming: bool,
                 log: Callable[[str], None] | None = None, saved: dict | None = None):
        self.path, self.run_cfg, self.resuming, self.log_note = Path(path), run_cfg, resuming, log
        self.config = saved  # config.json as on disk (None until a new run's is written)

    @classmethod
    def open(cls, path: str | Path, run_cfg: dict, resume: bool = False,
             log: Callable[[str], None] | None = None) -> RunFolder:
        path = Path(path)
        check_out_dir(path)
        if (path / "config.json").exists():
            if not resume:
                raise CheckpointError(f"{path} already holds a run; pass --resume to continue it "
                                      "or choose another --out")
            saved = read_run_config(path, fix="restore it as the run wrote it, or choose another --out",
                                    sections=[k for k in run_cfg if k not in ("software", "parallel", "init")])
            if "init" in run_cfg and "init" not in saved:
                raise CheckpointError(f"{path} was trained without --init-from, which a resumed run cannot add; "
                                      "resume without --init-from, or start a new run in another --out")
            there, now = _global_batch(saved), _global_batch(run_cfg)
            if there != now:
                world = run_cfg.get("parallel", {}).get("world_size", 1)
                accum = run_cfg["train"].get("grad_accum", 1)
                fix = (f"--batch-size {there // (accum * world)}" if there and there % (accum * world) == 0
                       else "--batch-size / --grad-accum to match")
                raise CheckpointError(f"{path} was trained at a global batch (batch_size x grad_accum x "
                                      f"processes) of {there}, and this run would use {now}; resume with {fix} "
                                      f"for {world} process(es), or choose another --out")
            for section, want in run_cfg.items():
                if section in ("software", "parallel"):
                    continue
                k = _first_difference(saved.get(section, {}), want, section)
                if k is None:
                    continue
                if section == "data" and k == "tokenizer_sha256":
                    raise CheckpointError(f"{path} was trained with another tokenizer "
                                          f"({saved['data'].get('tokenizer')!r}, sha256 "
                                          f"{str(saved['data'].get(k))[:12]}...); resume with the same "
                                          "--tokenizer or choose another --out")
                if section == "data" and k == "doc_sep":
                    raise CheckpointError(f"{path} was trained with --doc-sep {saved['data'].get(k)!r}, this run "
                                          f"would use {want.get(k)!r}; resume with the same --doc-sep or choose "
                                          "another --out")
                if section == "data":
                    raise CheckpointError(f"{path} was trained on other data ({saved.get('data', {}).get('source')}); "
                                          "resume with the same --data or choose another --out")
                raise CheckpointError(
                    f"{path} holds a run with a different {section} config ({k}: "
                    f"{saved.get(section, {}).get(k)!r} there, {want.get(k)!r} now); "
                    "resume with the same settings or choose another --out")
        elif any(os.path.lexists(path / name) for name in (CKPT, "metrics.jsonl")):
            raise CheckpointError(f"{path} holds a run's {CKPT}/ or metrics.jsonl but no config.json: the run "
                                  "is damaged; restore its config.json from a copy, or choose another --out "
                                  "(nothing was changed)")
        elif path.exists() and any(p for p in path.iterdir() if not p.name.startswith(TMP_PREFIX)):
            raise CheckpointError(f"{path} exists, holds no run and is not empty; choose another --out")
        elif resume:
            if log is not None:
                log(f"note: {path} holds no run yet; starting it")
            resume = False
        return cls(path, run_cfg, resume, log, saved if resume else None)

    @property
    def checkpoint(self) -> Path | None:
        return checkpoint_dir(self.path) if self.resuming else None

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def check(self) -> None:
        """Refuse damage before anything is changed: metrics.jsonl must parse and, when
        resuming, hold every training record up to the checkpoint (``check_records``)."""
        records = self._read_records()[1]
        if self.resuming and (self.path / "summary.json").is_file():  # a finished run's record of its end
            read_object(self.path / "summary.json", "a run summary", "restore it from a copy")
        ckpt = self.checkpoint
        if ckpt is None and self.resuming:
            lost = self._progress_without_checkpoint()
            if lost:
                raise CheckpointError(f"{self.path} {lost}, but its {CKPT}/ folder is missing or not a folder: "
                                      f"restore it from a copy, or train again in another --out (nothing was "
                                      "changed)")
        if ckpt is None or not isinstance(self.config, dict):
            return
        try:  # a damaged manifest or trainer.json is refused by name when the checkpoint loads
            meta = read_json(ckpt / MANIFEST) if (ckpt / MANIFEST).is_file() else read_json(ckpt / "trainer.json")
            step = meta["step"]
        except (PhaseloopError, KeyError, TypeError):
            return
        check_records(self.metrics_path, records, step, self.config.get("train", {}))

    def _progress_without_checkpoint(self) -> str | None:
        """What says this run got past a checkpoint although none is there (a lost folder:
        resuming from step 0 would retrain it and let --keep-checkpoints drop the new ones)."""
        if os.path.lexists(self.path / CKPT):
            return f"has a {CKPT} that is not a folder"
        if (self.path / "summary.json").is_file():
            return "finished (summary.json)"
        kept = sorted(p.name for p in self.path.glob(f"{CKPT}-*")) + (["best"] if (self.path / "best").is_dir() else [])
        return f"kept {kept[0]}" if kept else None  # (metrics alone are not: a first save may have died)

    def start(self, step: int) -> None:
        """Create the folder, remove orphans of interrupted writes, keep the metric
        records up to ``step``, write config.json."""
        lines, records, open_end = self._read_records()
        self.path.mkdir(parents=True, exist_ok=True)
        remove_orphans(self.path)
        if self.resuming and step == 0 and self.log_note is not None:
            self.log_note(f"note: {self.path} has no checkpoint yet; starting from step 0")
        keep = [line for line, r in zip(lines, records) if r.get("step", 0) <= step]
        # records after the checkpoint are logged again; a torn or unended last line is dropped
        # or ended, or the next record would join it
        if open_end or len(keep) < len(lines):
            atomic_write_bytes(self.metrics_path, ("\n".join(keep) + "\n" if keep else "").encode())
        if not (self.path / "config.json").exists():
            write_json(self.path / "config.json", self.run_cfg)
            self.config = json.loads(dumps(self.run_cfg))  # as written (the checkpoints record its digest)

    def _read_records(self) -> tuple[list[str], list[dict], bool]:
        """``_records`` of metrics.jsonl, parsed once for ``check`` and ``start`` (again if
        the file changed in between: its size and modification time)."""
        try:
            st = self.metrics_path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp is None or getattr(self, "_parsed", (None,))[0] != stamp:
            self._parsed = (stamp, _records(self.metrics_path))
        return self._parsed[1]

    def log(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(dumps(record) + "\n")

    def finish(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary)
