"""Training-step time with the document options (issue 28) against the same model without
them, side by side in one process: --doc-positions (per-row RoPE tables, horn, coordinate
signal), --doc-mask (attention within each document: SDPA with a dense [B, 1, T, T] mask on
CPU, FlexAttention on CUDA, ``phaseloop.docattn``), and both, for RoPE and 3PT N=3.

Windows are drawn from a stream of documents of ``--doc-len`` tokens on average
(exponential lengths, so a window holds seq/doc-len boundaries on average); the step
includes building the batch's document inputs (``data.Documents.inputs``), as training does.

    python benchmarks/bench_documents.py [--d-model 192 --layers 4 --heads 6 --batch 16 --seq 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import time_interleaved

from phaseloop import ModelConfig, build_model
from phaseloop.data import Documents
from phaseloop.engine import TrainConfig, make_optimizer

OPTIONS = {"plain": (False, False), "positions": (False, True), "mask": (True, False), "both": (True, True)}


def step_fn(cfg: ModelConfig, batch: int, seq: int, docs: Documents | None, device: str, seed: int = 0):
    """One full training step (forward + backward + AdamW) with ``docs``' inputs, or plain."""
    torch.manual_seed(seed)
    model = build_model(cfg).to(device)
    opt = make_optimizer(model, TrainConfig())
    gen = np.random.default_rng(seed)
    n_tokens = 1 << 20
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step():
        kw = {}
        if docs is not None:
            starts = gen.integers(0, n_tokens - seq, batch)
            kw = {k: v.to(device) for k, v in docs.inputs(starts, seq).items()}
        loss = model(x, y, **kw).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--doc-len", type=float, default=64.0, help="mean document length in tokens")
    ap.add_argument("--archs", default="rope,three_phase")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    lengths = np.random.default_rng(0).exponential(a.doc_len, size=int(4 * (1 << 20) / a.doc_len)).astype(np.int64) + 1
    starts = np.concatenate([[0], np.cumsum(lengths)])
    starts = starts[starts < 1 << 20]
    base = dict(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.heads,
                d_ff=8 * a.d_model // 3 // 32 * 32, max_seq_len=a.seq)
    print(f"torch {torch.__version__}, {a.device}, {torch.get_num_threads()} threads; d_model {a.d_model}, "
          f"{a.layers} layers, {a.heads} heads, batch {a.batch} x seq {a.seq}, documents of {a.doc_len:g} "
          f"tokens on average")
    print(f"{'arch':<13}" + "".join(f"{k + ' ms':>13}" for k in OPTIONS) + "".join(f"{k + '/plain':>16}"
                                                                                 for k in list(OPTIONS)[1:]))
    for arch in a.archs.split(","):
        cfg = ModelConfig(arch=arch, **base, **({"n_phases": 3} if arch == "three_phase" else {}))
        fns = {k: step_fn(cfg, a.batch, a.seq, Documents(starts, m, p) if m or p else None, a.device)
               for k, (m, p) in OPTIONS.items()}
        t = time_interleaved(fns, rounds=a.rounds)
        print(f"{arch:<13}" + "".join(f"{t[k] * 1e3:>13.1f}" for k in OPTIONS)
              + "".join(f"{t[k] / t['plain']:>16.3f}" for k in list(OPTIONS)[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
