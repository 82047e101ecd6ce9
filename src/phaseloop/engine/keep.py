"""Checkpoints kept beside the run's resume point (``--keep-checkpoints K``, ``--keep-best``).

The run resumes from RUN/checkpoint as before (written and swapped in by
``checkpoint.save_checkpoint``). After each write, ``Keeper`` hard-links its files (a copy
where the file system has no hard links) into a temporary folder, verifies them against
the manifest (size, sha256) and renames the folder into place:

- K >= 2: RUN/checkpoint-<step, 8 digits>, the last K such folders (older ones removed);
- keep_best: RUN/best, the checkpoint of the lowest validation loss so far (``val_loss``
  of the evaluation records). A step whose evaluation improves on it is checkpointed even
  off ``ckpt_every``, so the weights kept are those evaluated.

Each is a checkpoint folder that ``eval``, ``export`` and ``--init-from`` read like the run's
own. A kill at any point leaves each either as it was or complete: folders being built
or removed carry the temporary prefix (``remove_orphans`` clears them), and on resume
``sync`` keeps the resumed checkpoint if the kill came between its write and its keeping
(the best loss so far is read back from metrics.jsonl, the record of truth)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from phaseloop.engine.checkpoint import CKPT, MANIFEST, TMP_PREFIX, verify_checkpoint
from phaseloop.engine.run import read_metrics
from phaseloop.errors import CheckpointError
from phaseloop.files import read_json

BEST = "best"
_BEST_OLD = ".best.old"


def kept_name(step: int) -> str:
    return f"{CKPT}-{step:08d}"


def kept_steps(run_dir: Path) -> list[int]:
    """The steps of the RUN/checkpoint-<step> folders ``kept_name`` writes, ascending."""
    out = []
    for p in Path(run_dir).glob(f"{CKPT}-*"):
        tail = p.name[len(CKPT) + 1:]
        if p.is_dir() and tail.isdigit() and p.name == kept_name(int(tail)):  # not a copy named alike
            out.append(int(tail))
    return sorted(out)


def ckpt_step(ckpt: Path) -> int | None:
    return read_json(ckpt / MANIFEST).get("step") if (ckpt / MANIFEST).is_file() else None


def _remove(path: Path) -> None:
    """Out of sight at once (a rename), then deleted."""
    gone = path.with_name(f"{TMP_PREFIX}gone-{path.name}")
    path.rename(gone)
    shutil.rmtree(gone, ignore_errors=True)


def keep_copy(src: Path, dest: Path) -> Path:
    """``src``'s files at ``dest`` (replaced if there), verified before the rename."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=TMP_PREFIX))
    try:
        tmp.chmod(0o755)
        for f in src.iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:  # no hard links here: a copy
                shutil.copy2(f, tmp / f.name)
        verify_checkpoint(tmp)
        old = dest.with_name(_BEST_OLD) if dest.name == BEST else None
        if dest.exists():
            if old is None:
                _remove(dest)
            else:  # best is never absent: the previous one waits beside it until replaced
                shutil.rmtree(old, ignore_errors=True)
                dest.rename(old)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Keeper:
    """What a run keeps (``keep`` last checkpoints, and the best by ``val_loss`` when
    ``best``). Every process holds one (the decision to checkpoint a best step must be
    the same everywhere); ``writes``: this process touches the folder (rank 0)."""

    def __init__(self, run_dir: Path | None, keep: int = 1, best: bool = False, writes: bool = True):
        self.run_dir, self.keep, self.best, self.writes = run_dir, keep, best, writes
        self.best_loss, self.pending = float("inf"), None

    @property
    def active(self) -> bool:
        return self.run_dir is not None and (self.keep > 1 or self.best)

    def sync(self, step: int) -> None:
        """At setup, once the run folder is started (metrics.jsonl cut at ``step``): read
        the best loss so far back, and keep the resumed checkpoint if it was not kept yet."""
        if not self.active:
            return
        run_dir = Path(self.run_dir)
        if self.writes and (run_dir / _BEST_OLD).is_dir():  # killed mid-swap
            if not (run_dir / BEST).exists():
                (run_dir / _BEST_OLD).rename(run_dir / BEST)  # before the new best came in: the previous one
            else:
                shutil.rmtree(run_dir / _BEST_OLD)  # after: the superseded one
        evals = [(r["val_loss"], r["step"]) for r in read_metrics(run_dir)
                 if isinstance(r.get("val_loss"), (int, float)) and r.get("step", 0) <= step]
        if evals:
            self.best_loss, at = min(evals)
            if self.best and at == step and step > 0 and self.writes:
                if (run_dir / CKPT).is_dir() and ckpt_step(run_dir / CKPT) == step \
                        and (not (run_dir / BEST).is_dir() or ckpt_step(run_dir / BEST) != step):
                    keep_copy(run_dir / CKPT, run_dir / BEST)
        if self.keep > 1 and step > 0 and self.writes and step not in kept_steps(run_dir) \
                and (run_dir / CKPT).is_dir() and ckpt_step(run_dir / CKPT) == step:
            self._keep_last(step)

    def check(self) -> None:
        """Before the run folder is touched (on every rank: it only reads): the names
        ``--keep-best`` writes are folders (a file or a dangling link there would fail the
        first keep, after training), and the kept best is intact (a best that no later
        evaluation beats is never rewritten, so damage would stay)."""
        if not (self.active and self.best):
            return
        for name in (BEST, _BEST_OLD):
            path = Path(self.run_dir) / name
            if os.path.lexists(path) and not path.is_dir():
                raise CheckpointError(f"{path} is not a folder, where --keep-best keeps a checkpoint; "
                                      "move it out of the run folder, then resume")
        if (Path(self.run_dir) / BEST).is_dir():  # the run's own checkpoint is fine: say what to do with best/
            verify_checkpoint(Path(self.run_dir) / BEST, fix="restore best/ from a copy, remove it (the next better "
                              "evaluation keeps a new one), or resume without --keep-best")

    def evaluated(self, step: int, result: dict) -> bool:
        """An evaluation's result: True when it is the best so far (checkpoint this step)."""
        loss = result.get("val_loss")
        if not (self.active and self.best and isinstance(loss, (int, float)) and loss < self.best_loss):
            return False
        self.best_loss, self.pending = float(loss), step
        return True

    def saved(self, step: int) -> None:
        """After the checkpoint of ``step`` is written: keep it as told."""
        if not (self.active and self.writes):
            return
        run_dir = Path(self.run_dir)
        if self.keep > 1:
            self._keep_last(step)
        if self.pending == step:
            keep_copy(run_dir / CKPT, run_dir / BEST)
            self.pending = None

    def _keep_last(self, step: int) -> None:
        run_dir = Path(self.run_dir)
        keep_copy(run_dir / CKPT, run_dir / kept_name(step))
        for old in kept_steps(run_dir)[:-self.keep]:
            _remove(run_dir / kept_name(old))
