"""``phaseloop generate FILE.pte``: decode with an exported program in ExecuTorch's runtime
(XNNPACK: the kernels a phone or laptop app runs it with), through the one decoding loop
of ``phaseloop generate`` (``decoding.decode``: the same sampling rule, seed and greedy
ties), so the tokens are the run's own (tests/test_deploy_runtime.py).

The file is checked against the record ``export`` wrote beside it (its sha256) before it
loads, and read with the tokenizer beside it: a damaged, replaced or bare ``.pte`` is
refused by name. The program fixes what eager decoding chooses per call: the depth (UT +
ACT: the loop bound; its step methods stop where each token halts), the cache length,
batch 1, no exit rule, shared cache or speculation (docs/deploy.md, ExecuTorch).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from phaseloop.data.tokenizer import HFTokenizer
from phaseloop.decoding import decode
from phaseloop.deploy import EXTRA, record_digest, sidecars
from phaseloop.errors import CheckpointError, ConfigError
from phaseloop.files import read_json, sha256_file, why_missing
from phaseloop.inference import Generation, Options, recording_passes


@dataclass
class Exported:
    """A checked ``.pte`` loaded in the runtime (``model``: deploy.runtime.PteModel), its
    tokenizer and the record of its export."""

    path: Path
    model: object
    tokenizer: HFTokenizer
    record: dict

    @property
    def max_len(self) -> int:
        return self.record["metadata"]["get_max_seq_len"]


def _why_not_a_file(p: Path) -> str:
    """Why ``p`` is not a regular file to read: a folder, a symlink loop, a broken link, absent."""
    return "is a folder, not a file" if p.is_dir() else why_missing(p)


def _record(rec_path: Path) -> dict:
    """The export's record, checked for what ``generate FILE.pte`` reads from it."""
    record = read_json(rec_path)  # unreadable JSON: one line naming it
    meta = record.get("metadata") if isinstance(record, dict) else None
    if (not isinstance(meta, dict) or record.get("format") != "executorch"
            or not isinstance(record.get("pte_sha256"), str) or not _count(meta.get("get_max_seq_len"), 1)
            or not _count(meta.get("get_vocab_size"), 1)
            or not all(record.get(k) is None or _count(record[k], 0) for k in ("passes", "kv_cache_bytes"))):
        raise CheckpointError(f"{rec_path} is not the record of an ExecuTorch export; export the run again")
    if "record_sha256" in record and record["record_sha256"] != record_digest(record):  # absent: an older export
        raise CheckpointError(f"{rec_path} is damaged or was edited (its contents differ from its "
                              "record_sha256); export the run again")
    return record


def _count(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def open_pte(path, threads: int | None = None) -> Exported:
    """``path`` and its sidecars, checked, loaded; one-line errors for a missing or damaged
    file, a missing sidecar, a file other than its record's, or no ExecuTorch installed."""
    path = Path(path)
    if not path.is_file():
        if os.path.lexists(path):
            raise CheckpointError(f"{path} {_why_not_a_file(path)}; pass the .pte that `phaseloop export "
                                  "--format executorch` wrote")
        raise CheckpointError(f"{path}: no such .pte file; write one with `phaseloop export RUN --format "
                              f"executorch --out {path.name}`")
    tok_path, rec_path = sidecars(path)
    for p, what in ((rec_path, "record"), (tok_path, "tokenizer")):
        if os.path.lexists(p) and not p.is_file():
            raise CheckpointError(f"{path}: its {what} {p.name} {_why_not_a_file(p)}; keep the three files "
                                  "export wrote together or export the run again")
        if not p.is_file():
            raise CheckpointError(f"{path}: its {what} {p.name} is missing (export writes it beside the "
                                  ".pte); keep the three files together or export the run again")
    record = _record(rec_path)
    if sha256_file(path) != record["pte_sha256"]:
        raise CheckpointError(f"{path} is not the file its record {rec_path.name} describes (sha256 differs): "
                              "damaged or replaced; export the run again")
    if "tokenizer_sha256" in record and sha256_file(tok_path) != record["tokenizer_sha256"]:
        raise CheckpointError(f"{tok_path} is not the tokenizer its record {rec_path.name} describes (sha256 "
                              "differs): replaced; export the run again")
    try:
        from phaseloop.deploy.runtime import PteModel
    except ImportError:
        raise ConfigError(f"running a .pte needs ExecuTorch's runtime, which is not installed: {EXTRA}") from None
    return Exported(path, PteModel(path, threads), HFTokenizer(tok_path), record)


def check(exp: Exported, options: Options, prompt_BT: torch.Tensor) -> None:
    """One line for what a program cannot do, before it runs."""
    fixed = options.dynamic_flags()
    if fixed:
        raise ConfigError(f"{fixed[0]} with a .pte: an exported program runs its fixed depth with its own "
                          "cache; run the checkpoint instead (phaseloop generate RUN)")
    if prompt_BT.shape[0] != 1:
        raise ConfigError(f"a .pte decodes one sequence (batch 1), got {prompt_BT.shape[0]}")
    need = options.cache_positions(prompt_BT.shape[1])
    if prompt_BT.shape[1] < 1 or need > exp.max_len:
        raise ConfigError(f"prompt ({prompt_BT.shape[1]} tokens) + --max-new-tokens {options.max_new_tokens} "
                          f"need {need} positions; {exp.path.name} holds {exp.max_len} (get_max_seq_len): "
                          "ask for fewer, or export with a larger --max-seq-len")
    V = exp.record["metadata"]["get_vocab_size"]
    if prompt_BT.numel() and int(prompt_BT.max()) >= V:
        raise ConfigError(f"the prompt holds token id {int(prompt_BT.max())}, outside {exp.path.name}'s vocabulary "
                          f"of {V}: its tokenizer is not the run's; export the run again")


def step_fn(model):
    """``decode``'s step over a runtime program: the new tokens at the next positions (the
    cache lives inside the program; ``decode``'s own cache is not used)."""
    pos = 0

    def step(x_BT: torch.Tensor, _cache) -> SimpleNamespace:
        nonlocal pos
        logits = model(x_BT, pos)
        pos += x_BT.shape[1]
        steps = getattr(model, "last_passes", None)  # ACT: the steps each new token ran
        return SimpleNamespace(logits=logits, passes=None if steps is None else steps[-1])
    return step


def generate(exp: Exported, prompt_BT: torch.Tensor, options: Options, on_output=None) -> Generation:
    """Decode ``prompt_BT`` [1, T] in the runtime from position 0 (a new sequence)."""
    check(exp, options, prompt_BT)
    gen = torch.Generator().manual_seed(options.seed)
    passes, seen = recording_passes(exp.record.get("passes"), on_output)
    t0 = time.perf_counter()
    ids = decode(step_fn(exp.model), prompt_BT.cpu(), options.max_new_tokens, temperature=options.temperature,
                 top_k=options.top_k, generator=gen, eos_id=options.eos_id, on_output=seen)
    seconds = time.perf_counter() - t0
    n = ids.shape[1] - prompt_BT.shape[1]
    return Generation(ids, ids[:, prompt_BT.shape[1]:], seconds, passes[:n], exp.record.get("kv_cache_bytes") or 0)
