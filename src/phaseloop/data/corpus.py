"""Corpora: a data source (``sources``) tokenised once into the token store (``store``),
split into training and validation tokens, and drawn as windows.

The split holds out the last ``val_fraction`` of tokens; where the source has several
documents (files of a folder, records, WikiText articles, dataset rows) the cut falls on
the document boundary nearest to that point, so no document is split between them.
Training draws random contiguous windows (a seeded generator whose state checkpoints
keep), evaluation fixed, evenly spaced ones; both read across the store's shards.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np
import torch

from phaseloop.data import store as token_store
from phaseloop.data.sources import Source, resolve
from phaseloop.data.tokenizer import Tokenizer, load_tokenizer
from phaseloop.data.tokenizer import describe as describe_tokenizer
from phaseloop.errors import CheckpointError, DataError


@dataclass
class Corpus:
    name: str
    fingerprint: str  # of the source (see sources.py)
    n_files: int
    n_bytes: int
    tokenizer: Tokenizer
    tokens: token_store.TokenView
    doc_starts: np.ndarray  # token offset of every document
    source: dict
    args: dict  # how to load it again: spec, text_column, split, streaming[, doc_sep]

    def describe(self) -> dict:
        sep = {"doc_sep": self.args["doc_sep"]} if self.args.get("doc_sep") is not None else {}
        return {**self.source, "bytes": self.n_bytes, "tokens": int(len(self.tokens)),
                "documents": int(len(self.doc_starts)), "tokens_per_byte": len(self.tokens) / self.n_bytes,
                **describe_tokenizer(self.tokenizer), **sep, "load": self.args}

    def split(self, val_fraction: float = 0.1, min_len: int = 2):
        """(train, validation) tokens: the last ``val_fraction``, cut at the nearest
        document boundary when there are several documents and one lies within half the
        validation size of the cut (else at the token: a boundary further off would make
        the split far from ``val_fraction``, e.g. nearly all of the data held out)."""
        n = len(self.tokens)
        n_val = max(int(n * val_fraction), min_len)
        if n - n_val < min_len:
            raise DataError(f"data {self.name!r} is too small ({n} tokens) for windows of "
                            f"{min_len - 1}; use a larger file or a smaller --seq-len")
        cut = n - n_val
        ok = [int(s) for s in self.doc_starts[1:] if min_len <= s <= n - min_len]
        if ok:
            i = bisect.bisect_left(ok, cut)
            near = min(ok[max(0, i - 1): i + 1], key=lambda s: (abs(s - cut), s))
            cut = near if abs(near - cut) <= n_val / 2 else cut
        return self.tokens.view(0, cut), self.tokens.view(cut, n)


def load_corpus(spec: str | os.PathLike = "stdlib", tokenizer: str | Tokenizer = "bytes", *,
                text_column: str = "text", split: str = "train", streaming: bool = False,
                progress: bool = False, strict: bool = True, doc_sep: str | None = None) -> Corpus:
    """Resolve a source and tokenise it into the store (once; later calls reuse it).
    ``strict=False``: options that do not apply to the source pass (a trained run's data).
    ``doc_sep``: text of one token that stands between documents (``separator_id``)."""
    tok = load_tokenizer(tokenizer)
    sep = None if doc_sep is None else separator_id(tok, doc_sep)
    src: Source = resolve(spec, text_column, split, streaming, strict=strict)
    st = token_store.build(src, tok, progress=progress, sep=sep, sep_text=doc_sep)
    m = st.manifest
    args = {"spec": str(spec), "text_column": text_column, "split": split, "streaming": streaming,
            **({"doc_sep": doc_sep} if doc_sep is not None else {})}
    return Corpus(name=src.name, fingerprint=src.fingerprint, n_files=src.n_files, n_bytes=m["bytes"],
                  tokenizer=tok, tokens=st.tokens, doc_starts=st.docs, source=src.describe(), args=args)


def separator_id(tok: Tokenizer, text: str) -> int:
    """The one token id ``text`` encodes to with ``tok`` (the ``--doc-sep`` between documents)."""
    ids = tok.encode(text) if isinstance(text, str) and text else []
    if len(ids) != 1:
        raise DataError(f"--doc-sep {text!r} encodes to {len(ids)} tokens with tokenizer {tok.name}; pass text "
                        "that is exactly one token: a special token of the tokenizer (e.g. <|endoftext|> where "
                        "it has one) or, with --tokenizer bytes, one ASCII character such as a newline")
    return int(ids[0])


def corpus_args(data: dict) -> dict:
    """``load_corpus`` keyword arguments that load a run's data again (its config.json
    ``data`` section; runs of earlier versions recorded only the source)."""
    if not data.get("load") and not isinstance(data.get("source"), str):
        raise CheckpointError("the run's config.json names no data source (its data section has no load or "
                              "source); restore the file, or pass --data")
    return dict(data.get("load") or {"spec": data["source"]})


# ---------------------------------------------------------------------------- windows
class TrainBatches:
    """Random contiguous windows; its generator state is the data position, saved in
    checkpoints so a resumed run sees exactly the batches an uninterrupted one would.

    In a world of ``world`` processes each micro-batch draws the starts of all ranks'
    windows (``batch_size x world``) and rank ``rank`` keeps its slice: the windows a
    single process would draw at the same global batch (torch's draws are sequential,
    so one draw of n starts equals two of n/2), and a checkpoint resumes at any world
    size with the same global batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1, docs: Documents | None = None):
        if len(tokens) < seq_len + 1:
            raise DataError(f"training split has {len(tokens)} tokens, fewer than seq_len+1="
                            f"{seq_len + 1}; use more data or a smaller --seq-len")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world, self.docs = rank, world, docs
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        """(inputs, targets), and with ``docs`` a third item: the model's document inputs."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size * self.world,),
                               generator=self.gen)[self.rank * self.batch_size:][:self.batch_size]
        rows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        xy = torch.from_numpy(rows)
        if self.docs is None:
            return xy[:, :-1], xy[:, 1:]
        return xy[:, :-1], xy[:, 1:], self.docs.inputs(starts.numpy(), self.seq_len)

    def state(self) -> dict[str, torch.Tensor]:
        return {"generator": self.gen.get_state()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["generator"])


def eval_starts(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """Starts of ``eval_windows``' windows: evenly spaced over the split (deterministic)."""
    if n_tokens < seq_len + 1:
        raise DataError(f"validation split has {n_tokens} tokens, fewer than seq_len+1="
                        f"{seq_len + 1}; use more data or a smaller --seq-len")
    last = n_tokens - seq_len - 1
    n = max(1, min(n_windows, last // seq_len + 1 if last else 1))
    return np.linspace(0, last, n).round().astype(np.int64)


def eval_windows(tokens: np.ndarray, seq_len: int, n_windows: int) -> torch.Tensor:
    """Fixed windows [n, seq_len+1], evenly spaced over the split (deterministic)."""
    starts = eval_starts(len(tokens), seq_len, n_windows)
    return torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64))


@dataclass
class Documents:
    """Where documents start in a split (token offsets from its start), and which
    document inputs the model gets: ``mask`` attention within each document
    (``doc_ids_BT``), ``positions`` positions restarting at 0 at each document start
    (``positions_BT``; a window's first, partial document counts from the window start)."""

    starts: np.ndarray
    mask: bool = False
    positions: bool = False

    @classmethod
    def of(cls, corpus: Corpus, view, mask: bool, positions: bool) -> Documents | None:
        """The documents of ``view`` (a split of ``corpus.tokens``); None when neither option is on."""
        if not (mask or positions):
            return None
        d = np.asarray(corpus.doc_starts, dtype=np.int64)
        lo, hi = view.start - corpus.tokens.start, view.end - corpus.tokens.start
        return cls(d[(d >= lo) & (d < hi)] - lo, mask, positions)

    def inputs(self, starts, seq_len: int) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for windows of ``seq_len`` tokens at ``starts``."""
        idx_BT = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len)[None]
        doc_BT = np.searchsorted(self.starts, idx_BT, side="right") - 1  # -1: before the first start
        out = {}
        if self.mask:
            out["doc_ids_BT"] = torch.from_numpy(doc_BT)
        if self.positions:
            first_BT = np.where(doc_BT >= 0, self.starts[np.maximum(doc_BT, 0)] if len(self.starts) else 0, 0)
            out["positions_BT"] = torch.from_numpy(idx_BT - np.maximum(first_BT, idx_BT[:, :1]))
        return out
