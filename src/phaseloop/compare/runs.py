"""A comparison's runs as a list of descriptions: what each run trains, on which data,
into which folder. Every launcher (this process, local worker processes, Slurm array
tasks; ``launch``) runs the same descriptions, the tuning runs (``tune``) and the
reported ones alike; a description travels to a worker or a Slurm task as JSON
(``OUT/launch/NAME.json``). A run is finished when its folder holds summary.json (or, for
a tuning run, diverged.json). Runs share nothing but the token store: the seed and the
data order come from the run's own ``TrainConfig``, never from who runs it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from phaseloop.config import ModelConfig
from phaseloop.data.corpus import Corpus, load_corpus
from phaseloop.engine import TrainConfig, compiling, dist
from phaseloop.engine.checkpoint import checkpoint_dir, verify_checkpoint
from phaseloop.errors import CheckpointError
from phaseloop.files import read_json, write_json
from phaseloop.models import build_model

DIVERGED = "diverged.json"  # a tuning run stopped by a non-finite loss: scored as infinite
LAUNCH = "launch"  # OUT/launch/: run descriptions, run state, worker logs


@dataclass(frozen=True)
class CompareRun:
    name: str  # e.g. "rope-s0" (in OUT/runs/) or "tune/rope/lr0.002-s100" (its path in OUT)
    variant: str
    seed: int
    cfg: ModelConfig
    train: TrainConfig  # everything: [train], the variant's own settings, tuned ones, the seed
    out: Path  # the comparison folder
    data: dict  # load_corpus arguments: spec, tokenizer, text_column
    tuning: bool = False  # trains and scores on the tuning slice (``tuning_corpus``)
    compile_share: int = 1  # runs to launch that compile the same blocks (``share_compiles``)

    @property
    def run_dir(self) -> Path:
        return self.out / self.name if self.tuning else self.out / "runs" / self.name

    def _launch(self, suffix: str) -> Path:
        return self.out / LAUNCH / f"{self.name}{suffix}"

    @property
    def spec_path(self) -> Path:
        return self._launch(".json")

    @property
    def state_path(self) -> Path:
        """What the process running it last said (``grid.write_state``)."""
        return self._launch(".state.json")

    @property
    def job_path(self) -> Path:
        """The Slurm task it was last submitted as (``slurm.submit``)."""
        return self._launch(".job.json")

    @property
    def log_path(self) -> Path:
        return self._launch(".log")

    @property
    def finished(self) -> bool:
        return (self.run_dir / "summary.json").exists() or (self.tuning and (self.run_dir / DIVERGED).exists())

    def steps_done(self) -> int:
        if self.finished:
            return self.train.steps
        ckpt = checkpoint_dir(self.run_dir)
        if ckpt is None:
            return 0
        verify_checkpoint(ckpt, ("trainer.json",))
        return int(read_json(ckpt / "trainer.json")["step"])

    def corpus(self, loaded: Corpus | None = None) -> Corpus:
        """The data this run reads (``loaded``: the recipe's corpus, else loaded here):
        the reported corpus, or for a tuning run its tuning slice."""
        if loaded is None:

            with dist.main_first():  # rank 0 builds the token store, then the others read it
                loaded = load_corpus(self.data["spec"], self.data["tokenizer"], text_column=self.data["text_column"],
                                     doc_sep=self.data.get("doc_sep"))
        if not self.tuning:
            return loaded
        return tuning_corpus(loaded, self.train, self.train.seq_len or self.cfg.max_seq_len)

    def to_dict(self) -> dict:
        return {"name": self.name, "variant": self.variant, "seed": self.seed, "model": self.cfg.to_dict(),
                "train": self.train.to_dict(), "out": os.path.abspath(self.out), "data": self.data,
                "tuning": self.tuning, "compile_share": self.compile_share}

    def save(self) -> Path:
        write_json(self.spec_path, self.to_dict())
        return self.spec_path

    @classmethod
    def load(cls, path: str | Path) -> CompareRun:
        d = read_json(Path(path))
        keys = ("name", "variant", "seed", "model", "train", "out", "data", "tuning")
        if not isinstance(d, dict) or not set(keys) <= set(d) <= {*keys, "compile_share"} \
                or not isinstance(d.get("compile_share", 1), int) or d.get("compile_share", 1) < 1:
            raise CheckpointError(f"{path} is not a run description (keys {', '.join(keys)}, compile_share); "
                                  "rerun `phaseloop compare` to write it again")
        return cls(d["name"], d["variant"], d["seed"], ModelConfig.from_dict(d["model"]),
                   TrainConfig.from_dict(d["train"]), Path(d["out"]), d["data"], bool(d["tuning"]),
                   d.get("compile_share", 1))


def share_compiles(runs: list[CompareRun]) -> list[CompareRun]:
    """``runs`` with ``compile_share`` set: how many of them, from each on, compile the same
    blocks (under ``--compile auto`` the first compiles, the others load it from the cache)."""

    try:
        n = compiling.shares([(r.name, lambda r=r: build_model(r.cfg), r.train) for r in runs])
    except Exception:
        return runs
    return [dataclasses.replace(r, compile_share=n[r.name]) for r in runs]


class RunsPending(Exception):
    """Runs a launcher left to others (Slurm tasks, other processes) are not finished:
    nothing after them (the next tuning round, the reported runs, the report) can start
    yet; the same command goes on from there once they have."""

    def __init__(self, names: list[str], tuning: bool):
        super().__init__(f"{len(names)} {'tuning ' if tuning else ''}runs unfinished")
        self.names, self.tuning = names, tuning


def recipe_data(recipe) -> dict:
    """A recipe's ``load_corpus`` arguments, as a run description carries them."""
    return {"spec": recipe.data, "tokenizer": recipe.tokenizer, "text_column": recipe.text_column,
            "doc_sep": recipe.doc_sep}


def tuning_corpus(corpus: Corpus, tc: TrainConfig, seq_len: int) -> Corpus:
    """The tuning slice: the training portion of the reported split only (the tokens
    before the cut ``Corpus.split`` makes at ``tc.val_fraction``), so tuning never reads
    the reported validation tokens. A tuning run splits it again the same way: it trains
    on the first part and is scored on the last ``val_fraction`` of it."""
    train_tok, _ = corpus.split(tc.val_fraction, seq_len + 1)
    cut, n = len(train_tok), len(corpus.tokens)
    source = {**corpus.source, "fingerprint": f"{corpus.source.get('fingerprint')}[:{cut}]",
              "tuning_slice": {"tokens": [0, cut], "of": n, "val_fraction": tc.val_fraction}}
    return dataclasses.replace(corpus, tokens=train_tok, doc_starts=corpus.doc_starts[corpus.doc_starts < cut],
                               n_bytes=max(1, round(corpus.n_bytes * cut / n)), source=source)
