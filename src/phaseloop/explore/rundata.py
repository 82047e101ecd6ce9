"""Run and comparison folders for explore's Runs pages; no web here.

* ``MetricsTail``: a run's metrics.jsonl read incrementally (each poll parses only the
  bytes appended since the last; a last line without its newline is a record being
  written, left for the next poll; a file rewritten shorter, as a resumed run does, is
  read again from the start), columns kept in memory, ``downsample``d when served.
* ``find``: the runs and comparisons in a served folder (itself, the folders below it,
  a comparison's ``runs/``), never following a link.
* ``comparison``: a comparison's table as ``compare/report.py`` formats it, read from the
  summary.json it wrote (nothing recomputed), and the plots it lists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from phaseloop.analysis.params import format_count
from phaseloop.compare.evals import accuracy_verdict, fmt_acc
from phaseloop.compare.report import _fmt, _speed, _verdict
from phaseloop.errors import DataError
from phaseloop.files import read_json, read_object

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tok_per_s", "elapsed_s")
EVAL_KEYS = ("val_loss", "val_bpb", "val_ppl", "elapsed_s")


class MetricsTail:
    """The records of one metrics.jsonl as columns: ``train`` (records with ``lr``) and
    ``eval`` (records with ``val_loss``), each {"step": [...], key: [...]}."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reset()

    def _reset(self, ident=None) -> None:
        self.ident, self.offset, self.records, self.damaged, self.torn = ident, 0, 0, 0, False
        self._drawn = (None, None)  # (key, downsampled columns) of the last curves()
        self.train = {k: [] for k in ("step",) + TRAIN_KEYS}
        self.eval = {k: [] for k in ("step",) + EVAL_KEYS}

    def update(self) -> MetricsTail:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._reset()
            return self
        ident = (st.st_dev, st.st_ino)
        if ident != self.ident or st.st_size < self.offset:  # replaced or cut: read again
            self._reset(ident)
        if st.st_size == self.offset:
            return self
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n") + 1
        self.torn = bool(data[end:].strip())  # being written (or cut by a kill): next poll
        self.offset += end
        self._add(data[:end])
        return self

    def _add(self, chunk: bytes) -> None:
        lines = [line for line in chunk.split(b"\n") if line.strip()]
        if not lines:
            return
        try:  # one parse of the whole chunk; line by line only when some line is bad
            records = json.loads(b"[" + b",".join(lines) + b"]")
        except ValueError:
            records = []
            for line in lines:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    self.damaged += 1
        for r in records:
            step = r.get("step") if isinstance(r, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):  # a whole step, as the engine writes
                self.damaged += 1
                continue
            self.records += 1
            cols, keys = ((self.train, TRAIN_KEYS) if "lr" in r else
                          (self.eval, EVAL_KEYS) if "val_loss" in r else (None, ()))
            if cols is not None:
                cols["step"].append(r["step"])
                for k in keys:
                    v = r.get(k)
                    cols[k].append(v if isinstance(v, (int, float)) and not isinstance(v, bool) else None)

    def curves(self, max_points: int) -> dict:
        """The downsampled columns (computed again only when records came in)."""
        key = (self.ident, self.offset, self.records, max_points)
        if self._drawn[0] != key:
            self._drawn = (key, {"train": downsample(self.train, "loss", max_points),
                                 "eval": downsample(self.eval, "val_loss", max_points)})
        return {"records": self.records, "damaged_lines": self.damaged, "torn": self.torn, **self._drawn[1]}


def downsample(cols: dict, key: str, max_points: int) -> dict:
    """At most ``max_points`` rows of ``cols`` (+ n, the count before): per bucket of
    consecutive rows the ones holding the min and the max of ``key`` (spikes survive),
    always the first and the last row."""
    n = len(cols["step"])
    if n <= max_points:
        return {**cols, "n": n}
    ys = cols[key]
    buckets = max(1, (max_points - 2) // 2)
    keep = {0, n - 1}
    for b in range(buckets):
        lo, hi = 1 + b * (n - 2) // buckets, 1 + (b + 1) * (n - 2) // buckets
        idx = [i for i in range(lo, hi) if ys[i] is not None]
        if idx:
            keep.add(min(idx, key=ys.__getitem__))
            keep.add(max(idx, key=ys.__getitem__))
    rows = sorted(keep)
    return {**{k: [v[i] for i in rows] for k, v in cols.items()}, "n": n}


# ---------------------------------------------------------------------------- folders
def kind(path: Path) -> str | None:
    """'comparison' (holds recipe.json), 'run' (holds config.json), or None."""
    if (path / "recipe.json").is_file():
        return "comparison"
    if (path / "config.json").is_file():
        return "run"
    return None


def _dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


MAX_DEPTH = 3  # folder levels searched below a served folder for runs
MAX_VISITS = 2000  # folders looked at per listing (a served home folder stays quick)


def find(base: Path) -> list[tuple[str, str]]:
    """(kind, path relative to ``base``) of the runs and comparisons in ``base``: itself,
    the folders below it (``MAX_DEPTH`` levels, not inside a run), each comparison's
    runs/<name>."""
    found, visits = [], [0]

    def visit(p: Path, depth: int) -> None:
        visits[0] += 1
        if visits[0] > MAX_VISITS:
            return
        k = kind(p)
        if k:
            found.append((k, p.relative_to(base).as_posix() if p != base else ""))
        if k == "comparison":
            for r in _dirs(p / "runs") if not (p / "runs").is_symlink() else []:
                if kind(r) == "run":
                    found.append(("run", r.relative_to(base).as_posix()))
        elif k is None and depth < MAX_DEPTH:
            for child in _dirs(p):
                visit(child, depth + 1)

    visit(base, 0)
    return found


def run_info(path: Path) -> dict:
    """What the list shows of a run: arch, steps done / planned, finished, final loss."""
    info: dict = {"finished": (path / "summary.json").is_file()}
    try:
        cfg = read_object(path / "config.json")
        model, train = (cfg.get(k) if isinstance(cfg.get(k), dict) else {} for k in ("model", "train"))
        info.update(arch=model.get("arch"), steps=train.get("steps"))
    except Exception as e:  # a damaged config is shown, not fatal to the list
        info["error"] = str(e).splitlines()[0]
    if info["finished"]:
        try:
            s = read_object(path / "summary.json")
            info.update(step=s.get("step"), val_loss=s.get("val_loss"), val_bpb=s.get("val_bpb"))
        except Exception as e:
            info["error"] = str(e).splitlines()[0]
    return info


def comparison(path: Path) -> dict:
    """A comparison's table (report.py's own cell formats), per-seed final losses and
    plots, from the summary.json its report wrote; before it is written, its runs only.
    A recipe.json or summary.json of another shape is refused by name (a 400)."""
    try:
        return _comparison(path)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:  # ValueError: a format of text
        raise DataError(f"the comparison {path.name}'s recipe.json or summary.json is damaged "
                        f"({type(e).__name__}: {str(e)[:60]}); write its report again: phaseloop compare "
                        f"--out {path.name} --report") from None


def _own_file(folder: Path, name) -> bool:
    """``name`` is a relative path to a file inside ``folder`` (a plot the report wrote), not
    an absolute one, a way out or a link."""
    if not isinstance(name, str) or not name or "\0" in name or name.startswith(("/", "\\")):
        return False
    p = folder / name
    return ".." not in Path(name).parts and not p.is_symlink() and p.is_file() and \
        p.resolve().is_relative_to(folder.resolve())


def _comparison(path: Path) -> dict:
    recipe = read_json(path / "recipe.json").get("recipe", {})
    runs = [rel for k, rel in find(path) if k == "run"]
    out = {"name": recipe.get("name"), "description": recipe.get("description"),
           "seeds": recipe.get("seeds"), "reference": recipe.get("reference"), "runs": runs,
           "summarized": (path / "summary.json").is_file(), "rows": [], "plots": []}
    if not out["summarized"]:
        return out
    s = read_json(path / "summary.json")
    out.update(target_val_loss=s.get("target_val_loss"), train_time_s=s.get("train_time_s"),
               plots=[p for p in s.get("plots", []) if _own_file(path, p)])
    for v in s["variants"]:
        row = {"name": v["name"], "spec": v.get("spec"), "seeds": v["finished_seeds"]}
        if v["finished_seeds"]:
            test = v.get("vs_reference")
            row.update(
                params=format_count(v["params"]), depth=v["depth"],
                val_loss=_fmt(v["val_loss"]["mean"], v["val_loss"]["std"]),
                val_bpb=_fmt(v["val_bpb"]["mean"], v["val_bpb"]["std"]),
                val_ppl=_fmt(v["val_ppl"]["mean"], v["val_ppl"]["std"], 2),
                tok_per_s=_fmt(v["tok_per_s"]["mean"], None, 0),
                step_speedup=_speed(v["step_speedup"]), wallclock_speedup=_speed(v["wallclock_speedup"]),
                vs_reference=_verdict(test), p=None if test is None else test.get("p"),
                vs_control="" if not v.get("vs_control") else
                f"{_verdict(v['vs_control'])} vs {v['vs_control']['control']}",
                final={str(k): f.get("val_loss") for k, f in v.get("final", {}).items()},
                raw={"val_loss": v["val_loss"]["mean"], "step_speedup": v["step_speedup"]})
        out["rows"].append(row)
    out["downstream"] = _downstream(s)
    return out


def _downstream(s: dict) -> dict:
    """The [eval] tasks' accuracy as report.md's Downstream section gives it (mean ± std
    over seeds per task, the average, its paired test against the reference)."""
    done = [v for v in s["variants"] if v.get("downstream")]
    tasks = list(done[0]["downstream"]["tasks"]) if done else []
    rows = []
    for v in done:
        d = v["downstream"]
        rows.append({"name": v["name"], "seeds": d["seeds"],
                     "cells": {t: fmt_acc(d["tasks"][t]["mean"], d["tasks"][t]["std"]) for t in tasks},
                     "average": fmt_acc(d["average"]["mean"], d["average"]["std"]),
                     "vs_reference": accuracy_verdict(d["average"]["vs_reference"]),
                     "p": (d["average"]["vs_reference"] or {}).get("p")})
    return {"tasks": tasks, "metrics": {t: done[0]["downstream"]["tasks"][t]["metric"] for t in tasks},
            "chance": done[0]["downstream"]["chance"] if done else None, "rows": rows}
