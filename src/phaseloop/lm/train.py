"""Language-model training on a corpus: random windows of tokens in, validation loss,
perplexity and bits per byte out, on the one training engine (``phaseloop.engine``,
whose ``TrainConfig`` is re-exported here). The CLI, the comparison runner and the tests
all call ``train``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from phaseloop.analysis.params import measure
from phaseloop.config import ModelConfig
from phaseloop.data.corpus import Corpus, Documents, TrainBatches, eval_starts, eval_windows, load_corpus
from phaseloop.data.tokenizer import ByteTokenizer, Tokenizer
from phaseloop.engine import RunFolder, TrainConfig, Trainer, autocast, dist, software_versions
from phaseloop.engine.checkpoint import TOKENIZER_COPY, checkpoint_dir
from phaseloop.engine.initfrom import check_tokenizer, provenance
from phaseloop.engine.run import read_metrics
from phaseloop.engine.weighting import ignore_targets
from phaseloop.errors import ConfigError
from phaseloop.files import atomic_write_bytes, read_json
from phaseloop.model import DecoderLM, build_model


def fit_vocab(cfg: ModelConfig, tokenizer, explicit: bool = False,
              log: Callable[[str], None] | None = None) -> ModelConfig:
    """The config with the tokenizer's vocabulary: a preset's vocab_size is set to the
    tokenizer's (saying so through ``log``); an ``explicit`` one must hold every token."""
    if explicit or cfg.vocab_size == tokenizer.vocab_size:
        if cfg.vocab_size < tokenizer.vocab_size:
            raise ConfigError.invalid(f"vocab_size={cfg.vocab_size}: smaller than the "
                              f"{tokenizer.name} tokenizer's {tokenizer.vocab_size}; set "
                              f"vocab_size={tokenizer.vocab_size}")
        return cfg
    if log is not None:
        log(f"note: vocab_size {cfg.vocab_size} -> {tokenizer.vocab_size} to match the "
            f"{tokenizer.name} tokenizer")
    return cfg.replace(vocab_size=tokenizer.vocab_size)


def check_seq_len(seq_len: int, cfg: ModelConfig) -> None:
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len {seq_len} is longer than the model's max_seq_len "
                          f"{cfg.max_seq_len}; use --seq-len {cfg.max_seq_len} or less, or build "
                          f"the model with --set max_seq_len={seq_len}")


def ignore_id_fault(ignore_id: int | None, cfg: ModelConfig) -> str | None:
    """Why a ``loss_ignore_id`` leaves nothing out (no token has it), or None: refused for a
    new run (a run that recorded one still resumes; compare checks each variant before its
    folder is written)."""
    if ignore_id is not None and ignore_id >= cfg.vocab_size:
        return (f"loss_ignore_id={ignore_id}: no token has it (the vocabulary holds ids 0 .. {cfg.vocab_size - 1}); "
                "name the id to leave out, or drop it")
    return None


def last_evaluation(run_dir: Path, step: int) -> dict:
    """``evaluate``'s figures as metrics.jsonl logged them at ``step`` ({} where none was)."""
    found = [r for r in read_metrics(run_dir) if r["step"] == step and "lr" not in r]
    return {k: v for k, v in found[-1].items() if k.startswith("val_")} if found else {}


@torch.no_grad()
def evaluate(model: DecoderLM, windows: torch.Tensor, tokenizer: Tokenizer | None = None,
             batch_size: int = 16, device: torch.device | str = "cpu", ignore_id: int | None = None,
             docs: dict[str, torch.Tensor] | None = None) -> dict:
    """Validation loss (nats/token), perplexity and bits per byte over fixed windows:
    BPB = total nats / (ln 2 x the UTF-8 bytes the predicted tokens decode to, counted per
    window by the tokenizer; one per token for bytes), with tokens per byte beside it and,
    for a word-level tokenizer, the perplexity per word. ``ignore_id`` (the run's
    ``loss_ignore_id``): targets equal to it count in neither the nats, the tokens nor
    the bytes, as training leaves them out of the loss. ``docs``: the windows' document
    inputs ([n, seq_len] each, ``eval_set``)."""
    tokenizer = tokenizer or ByteTokenizer()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    # in a world, rank r evaluates windows r, r + W, ... (as many batches on every rank,
    # the last padded with window 0 and not counted: FSDP2's forward is a collective)
    w_ = dist.world()
    targets = windows[:, 1:].numpy()
    if ignore_id is None:
        n_bytes = int(tokenizer.window_bytes(targets).sum())
    else:
        n_bytes = sum(int(tokenizer.window_bytes(r[r != ignore_id][None]).sum()) for r in targets)
    docs = docs or {}
    mine = windows[w_.rank::w_.size]
    mine_docs = {k: v[w_.rank::w_.size] for k, v in docs.items()}
    per_rank = -(-len(windows) // w_.size)
    nll, n_tok = 0.0, 0
    for i in range(0, per_rank, batch_size):
        w = mine[i: i + batch_size]
        kw = {k: v[i: i + batch_size] for k, v in mine_docs.items()}
        real = len(w)
        want = min(batch_size, per_rank - i)
        if real < want:
            w = torch.cat([w, windows[:1].expand(want - real, -1)])
            kw = {k: torch.cat([v, docs[k][:1].expand(want - real, -1)]) for k, v in kw.items()}
        w = w.to(device)
        x, y = w[:, :-1], w[:, 1:]
        with autocast(device):
            logits = model(x, **{k: v.to(device) for k, v in kw.items()}).logits.float()[:real]
        _, y = ignore_targets((x, y[:real]), ignore_id)  # the training loss's masking
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        n_tok += int((y != -100).sum())
    nll, n_tok = (float(v) for v in dist.all_sum(nll, n_tok))
    n_tok = int(n_tok)
    model.train(was_training)
    loss = nll / max(n_tok, 1)
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
           "val_bpb": nll / (math.log(2) * max(n_bytes, 1)), "val_tokens": n_tok,
           "val_tokens_per_byte": n_tok / max(n_bytes, 1)}
    if tokenizer.kind == "wordlevel":  # one token per word: the paper's word-level PPL
        out["val_word_ppl"] = out["val_ppl"]
    return out


def lm_loss(model, batch, device):
    """Next-token loss of one (inputs, targets[, document inputs]) window batch."""
    x, y, *rest = batch
    docs = {k: v.to(device, non_blocking=True) for k, v in (rest[0] if rest else {}).items()}
    return model(x.to(device, non_blocking=True), y.to(device, non_blocking=True), **docs)


def eval_set(corpus: Corpus, tokens, seq_len: int, n_windows: int, train_cfg: dict):
    """(windows, document inputs or None) of a split, as the run's training saw documents."""
    windows = eval_windows(tokens, seq_len, n_windows)
    docs = Documents.of(corpus, tokens, train_cfg.get("doc_mask", False), train_cfg.get("doc_positions", False))
    if docs is None:
        return windows, None
    return windows, docs.inputs(eval_starts(len(tokens), seq_len, n_windows), seq_len)


def init_section(tc: TrainConfig, data: dict, out_dir: str | Path, resume: bool,
                 model_cfg: ModelConfig | None = None) -> dict:
    """{"init": provenance} of a run started from another run's weights (``initfrom``),
    its tokenizer checked, the model fields that differ from the source's recorded; a
    resumed run past its first checkpoint keeps the one recorded."""
    if tc.init_from is None:
        return {}

    out_dir = Path(out_dir)
    if resume and checkpoint_dir(out_dir) is not None and (out_dir / "config.json").is_file():
        saved = read_json(out_dir / "config.json")
        if isinstance(saved, dict) and "init" in saved:
            return {"init": saved["init"]}
    check_tokenizer(tc.init_from, data, tc.allow_new_tokenizer)
    return {"init": provenance(tc.init_from, model_cfg)}


def train(model_cfg: ModelConfig, tc: TrainConfig, data: str | Corpus = "stdlib",
          out_dir: str | Path = "runs/run", resume: bool = False, progress: bool = True,
          on_step: Callable[[int, dict], None] | None = None, stop_after: int | None = None,
          log: Callable[[str], None] | None = None, compile_share: int = 1) -> dict:
    """Train a model on a corpus; returns the run summary (also written to ``summary.json``).

    ``stop_after`` ends the process-local loop after that many steps without finishing
    the run (used to test interruption); ``on_step`` receives every logged record;
    ``log`` the notes (e.g. "nothing to resume yet; starting"); ``compile_share`` the runs
    that compile the same blocks (``Trainer``).
    """
    tc.check()  # a field assigned since it was built is checked before the run folder is touched
    corpus = data if isinstance(data, Corpus) else load_corpus(data)
    fit_vocab(model_cfg, corpus.tokenizer, explicit=True)
    seq_len = tc.seq_len or model_cfg.max_seq_len
    check_seq_len(seq_len, model_cfg)
    why = None if resume else ignore_id_fault(tc.loss_ignore_id, model_cfg)
    if why is not None:
        raise ConfigError.invalid(why, "train config")
    run_cfg = {"model": model_cfg.to_dict(), "train": tc.to_dict(), "data": corpus.describe(),
               "parallel": {"world_size": dist.world().size}, "software": software_versions(model_cfg.arch),
               **init_section(tc, corpus.describe(), out_dir, resume, model_cfg)}
    run = RunFolder.open(out_dir, run_cfg, resume, log if dist.world().main else None)
    dist.barrier()  # every rank has checked the folder before rank 0 writes to it
    train_tok, val_tok = corpus.split(tc.val_fraction, seq_len + 1)
    w = dist.world()
    batches = TrainBatches(train_tok, seq_len, tc.batch_size, tc.seed, w.rank, w.size,
                           Documents.of(corpus, train_tok, tc.doc_mask, tc.doc_positions))
    windows, docs = eval_set(corpus, val_tok, seq_len, tc.eval_windows, tc.to_dict())
    trainer = Trainer(lambda: build_model(model_cfg), tc, batches, lm_loss,
                      evaluate=lambda m: evaluate(m, windows, corpus.tokenizer, tc.batch_size, trainer.device,
                                                  tc.loss_ignore_id, docs),
                      run=run, progress=progress, desc=run.path.name, on_step=on_step,
                      flops_per_token=lambda depth: measure(model_cfg, seq_len, depth,  # None: no MFU
                                                            tc.extend_loops if depth else None)["flops_per_token"],
                      compile_share=compile_share, log=log)
    trainer.setup()  # writes config.json: the tokenizer's copy goes in beside it
    if trainer.step >= tc.steps:  # a finished run (killed before its summary.json?): its last evaluation
        trainer.last_eval = last_evaluation(run.path, trainer.step)
    if w.main and corpus.tokenizer.path is not None and not (run.path / TOKENIZER_COPY).exists():
        atomic_write_bytes(run.path / TOKENIZER_COPY, corpus.tokenizer.path.read_bytes())
    summary = {**trainer.fit(stop_after), "data": corpus.describe(), **({"world_size": w.size} if w.size > 1 else {})}
    if summary["finished"] and trainer.ran == 0 and (run.path / "summary.json").exists():
        return read_json(run.path / "summary.json")  # resumed a finished run: nothing new
    if summary["finished"] and w.main:
        run.finish(summary)
    dist.barrier()
    return summary
