"""Training and evaluation: one function each, called by the CLI, the comparison runner
and the tests alike."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .checkpoint import (checkpoint_dir, load_model_state, load_trainer_state, optimizer_state,
                         read_json, save_checkpoint, write_json)
from .config import ModelConfig
from .data import Corpus, TrainBatches, atomic_write_bytes, eval_windows, load_corpus
from .errors import CheckpointError, ConfigError
from .validation import check_ints, strict_from_dict
from .model import DecoderLM, build_model


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int | None = None  # None -> the model's max_seq_len
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_steps: int = 50
    weight_decay: float = 0.1  # matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 32
    ckpt_every: int = 100
    log_every: int = 10
    val_fraction: float = 0.1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compile: bool = False

    def __post_init__(self) -> None:
        what = "train config"
        check_ints(self, ("steps", "batch_size", "grad_accum", "eval_every", "eval_windows",
                          "ckpt_every", "log_every"), what)
        check_ints(self, ("seq_len",), what, optional=True)
        check_ints(self, ("warmup_steps", "seed"), what, minimum=0)
        if not self.lr > 0:
            raise ConfigError(f"invalid train config: lr={self.lr!r}: must be > 0")
        for name in ("min_lr_ratio", "weight_decay", "beta1", "beta2"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"invalid train config: {name}={getattr(self, name)!r}: must be in [0, 1]")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"invalid train config: val_fraction={self.val_fraction!r}: must be in (0, 1)")
        if not self.grad_clip > 0:
            raise ConfigError(f"invalid train config: grad_clip={self.grad_clip!r}: must be > 0")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError(f"invalid train config: device={self.device!r}: use auto, cpu or cuda[:N]")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return strict_from_dict(cls, d, "train config")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"invalid train config: device={name!r}: no CUDA device here; use --device cpu")
    return torch.device(name)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup to lr, then cosine to min_lr_ratio * lr at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    floor = tc.lr * tc.min_lr_ratio
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (dim >= 2); norms, angles, biases, gains
    are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=1e-8,
                             foreach=True)


def autocast(device: torch.device):
    """bf16 autocast on CUDA only; fp32 on CPU (bf16 matmuls are ~50x slower there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(model: DecoderLM, windows: torch.Tensor, token_bytes=None, batch_size: int = 16,
             device: torch.device | str = "cpu") -> dict:
    """Validation loss (nats/token), perplexity and bits per byte over fixed windows.
    BPB = total nats / (ln 2 * total bytes of the predicted tokens)."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    tb = torch.as_tensor(token_bytes if token_bytes is not None else [1] * model.cfg.vocab_size)
    nll, n_tok, n_bytes = 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i: i + batch_size].to(device)
        x, y = w[:, :-1], w[:, 1:]
        with autocast(device):
            logits = model(x).logits.float()
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        n_tok += y.numel()
        n_bytes += int(tb[y.cpu()].sum())
    model.train(was_training)
    loss = nll / n_tok
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
            "val_bpb": nll / (math.log(2) * n_bytes), "val_tokens": n_tok}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def software_versions() -> dict:
    return {"phaseloop": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def _check_resume(run_dir: Path, saved: dict, want: dict) -> None:
    for section in ("model", "train"):
        diff = [k for k in sorted(set(saved.get(section, {})) | set(want[section]))
                if saved.get(section, {}).get(k) != want[section].get(k)
                and k not in ("device", "compile")]
        if diff:
            k = diff[0]
            raise CheckpointError(
                f"{run_dir} holds a run with a different {section} config ({k}: "
                f"{saved.get(section, {}).get(k)!r} there, {want[section].get(k)!r} now); "
                "resume with the same settings or choose another --out")
    if saved.get("data", {}).get("fingerprint") != want["data"]["fingerprint"]:
        raise CheckpointError(f"{run_dir} was trained on other data ({saved.get('data', {}).get('source')}); "
                              "resume with the same --data or choose another --out")


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records logged after the checkpoint (they will be re-logged)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write_bytes(path, ("\n".join(keep) + "\n" if keep else "").encode())


def train(model_cfg: ModelConfig, tc: TrainConfig, data: str | Corpus = "stdlib",
          out_dir: str | Path = "runs/run", resume: bool = False, progress: bool = True,
          on_step: Callable[[int, dict], None] | None = None, stop_after: int | None = None) -> dict:
    """Train a model; returns the run summary (also written to ``summary.json``).

    ``stop_after`` ends the process-local loop after that many steps without finishing
    the run (used to test interruption); ``on_step`` receives every logged record.
    """
    run_dir = Path(out_dir)
    corpus = data if isinstance(data, Corpus) else load_corpus(data)
    seq_len = tc.seq_len or model_cfg.max_seq_len
    if model_cfg.vocab_size < corpus.tokenizer.vocab_size:
        raise ConfigError(f"invalid config: vocab_size={model_cfg.vocab_size}: smaller than the "
                          f"tokenizer's {corpus.tokenizer.vocab_size}; set vocab_size="
                          f"{corpus.tokenizer.vocab_size}")
    run_cfg = {"model": model_cfg.to_dict(), "train": tc.to_dict(), "data": corpus.describe(),
               "software": software_versions()}
    if (run_dir / "config.json").exists():
        if not resume:
            raise CheckpointError(f"{run_dir} already holds a run; pass --resume to continue it "
                                  "or choose another --out")
        _check_resume(run_dir, read_json(run_dir / "config.json"), run_cfg)
    elif resume:
        raise CheckpointError(f"{run_dir} holds no run to resume; drop --resume to start one")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise CheckpointError(f"{run_dir} exists and is not empty; choose another --out")

    device = resolve_device(tc.device)
    torch.manual_seed(tc.seed)
    model = build_model(model_cfg).to(device)
    opt = make_optimizer(model, tc)
    train_tok, val_tok = corpus.split(tc.val_fraction, seq_len + 1)
    batches = TrainBatches(train_tok, seq_len, tc.batch_size, tc.seed)
    windows = eval_windows(val_tok, seq_len, tc.eval_windows)
    token_bytes = corpus.tokenizer.token_bytes()

    step, elapsed = 0, 0.0
    ckpt = checkpoint_dir(run_dir) if resume else None
    if ckpt is not None:
        meta, tensors = load_trainer_state(ckpt)
        load_model_state(model, ckpt)
        opt.load_state_dict(optimizer_state(meta, tensors))
        torch.set_rng_state(tensors["rng.torch"])
        batches.set_state(tensors["data.generator"])
        step, elapsed = meta["step"], meta.get("elapsed", 0.0)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    _truncate_metrics(metrics_path, step)
    if ckpt is None:
        write_json(run_dir / "config.json", run_cfg)

    fwd = torch.compile(model) if tc.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = tc.batch_size * tc.grad_accum * seq_len
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=step, desc=run_dir.name, unit="step", dynamic_ncols=True)

    def log(record: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if on_step is not None:
            on_step(record["step"], record)

    last_eval: dict = {}
    model.train()
    t_last, tok_since, ran = time.perf_counter(), 0, 0
    while step < tc.steps:
        if stop_after is not None and ran >= stop_after:
            break
        lr = lr_at(step, tc)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum, aux_sum = 0.0, {}
        for _ in range(tc.grad_accum):
            x, y = batches.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device):
                out = fwd(x, y)
            (out.loss / tc.grad_accum).backward()
            loss_sum += out.ce_loss.item() / tc.grad_accum
            for k, v in out.aux_losses.items():
                aux_sum[k] = aux_sum.get(k, 0.0) + v.item() / tc.grad_accum
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ran += 1
        tok_since += tokens_per_step
        if step % tc.log_every == 0 or step == tc.steps:
            now = time.perf_counter()
            dt = now - t_last
            elapsed += dt
            rec = {"step": step, "loss": loss_sum, "lr": lr, "grad_norm": float(gnorm),
                   "tokens": step * tokens_per_step, "tok_per_s": tok_since / max(dt, 1e-9),
                   "elapsed_s": elapsed, **aux_sum}
            log(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{rec['tok_per_s']:.0f}")
            t_last, tok_since = time.perf_counter(), 0
        if bar is not None:
            bar.update(1)
        if step % tc.eval_every == 0 or step == tc.steps:
            t0 = time.perf_counter()
            last_eval = evaluate(model, windows, token_bytes, tc.batch_size, device)
            log({"step": step, **last_eval, "elapsed_s": elapsed})
            t_last += time.perf_counter() - t0  # evaluation time is not training time
        if step % tc.ckpt_every == 0 or step == tc.steps:
            t0 = time.perf_counter()
            save_checkpoint(run_dir, model, opt, step, batches.state(), {"elapsed": elapsed})
            t_last += time.perf_counter() - t0
    if bar is not None:
        bar.close()

    summary = {"run": str(run_dir), "step": step, "finished": step >= tc.steps,
               "params": n_params, "elapsed_s": elapsed,
               "tok_per_s": step * tokens_per_step / max(elapsed, 1e-9),
               "peak_memory_mb": peak_memory_mb(device), "data": corpus.describe(), **last_eval}
    if step >= tc.steps:
        write_json(run_dir / "summary.json", summary)
    return summary
