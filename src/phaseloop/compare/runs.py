"""A comparison's runs as a list of descriptions: what each run trains, on which data,
into which folder. The runner (one process, or a launcher of several) iterates them; a
run is finished when its folder holds summary.json (or, for a tuning run, diverged.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import checkpoint_dir, read_json, verify_checkpoint
from ..config import ModelConfig
from ..data import Corpus
from ..engine import TrainConfig

DIVERGED = "diverged.json"  # a tuning run stopped by a non-finite loss: scored as infinite


@dataclass(frozen=True)
class RunSpec:
    name: str  # e.g. "rope-s0" (its folder's name) or "tune/rope/lr0.002-s100" (its path)
    variant: str
    seed: int
    cfg: ModelConfig
    train: TrainConfig  # everything: [train], the variant's own settings, tuned ones, the seed
    run_dir: Path
    tuning: bool = False  # trains and scores on the tuning slice (``tuning_corpus``)

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
