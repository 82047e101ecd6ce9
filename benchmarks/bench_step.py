"""How close a training step is to its matmul floor (issue 17).

For each shape and architecture: the full training step (forward, backward, clip, AdamW)
against its **floor** — the same matrix products and attention calls alone, replayed on
the very tensors the step used (captured at the aten level with a TorchDispatchMode, so
backward products count too) — interleaved, medians; the forward / backward split; and
the top operators by self CPU time (torch.profiler). At the nanoGPT CPU shape a GPT-2-style
block (LayerNorm, GELU MLP 4·d, learned positions; written here) is timed beside it.

    python benchmarks/bench_step.py                 # every shape, ~4 min on 2 cores
    python benchmarks/bench_step.py --shapes nanogpt --archs rope --top 12
    python benchmarks/bench_step.py --compile block # eager vs compiled, end to end

``--compile MODE`` times each model's eager step against the same step compiled: ``model``
(the loss function, as ``--compile model`` does), ``block`` (every Block's forward on its
instance, as ``--compile block`` does; the GPT-2 blocks likewise) or ``pieces`` (only the
elementwise pieces the CPU lacks fused kernels for, each a compiled function: RMSNorm
forward + backward, RoPE applied to q and k together; GPT-2's LayerNorm already has
them). It prints the compile time (the first compiled step, less an eager step), the
break-even run length (the steps after which compiling has paid for itself) and the
compiled step against the eager step's matmul floor (the same products).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_interleaved

from phaseloop import ModelConfig, build_model
from phaseloop.engine import TrainConfig, make_optimizer
from phaseloop.layers import Attention, Block, RMSNorm, apply_rope

# name -> (preset, overrides, batch, seq)
SHAPES = {
    "rope-tiny": ("rope-tiny", {}, 16, 64),
    "rope-small": ("rope-small", {}, 16, 128),
    "nanogpt": ("rope-tiny", dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=None, max_seq_len=64), 12, 64),
    "rope-5.5m": ("rope-5.5m", {}, 8, 128),
}
ARCHS = {"rope": {}, "3pt": {"arch": "three_phase"}, "universal": {"arch": "universal"},
         "hyperloop": {"arch": "hyperloop"}}
FLOOR_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_backward"}


def config(shape: str, arch: str) -> ModelConfig:
    preset, over, _, _ = SHAPES[shape]
    d = {**over, **ARCHS[arch]}
    if arch == "universal":
        d.update(n_layers=1, n_steps=ModelConfig.from_preset(preset, **over).n_layers)
    base = ModelConfig.from_preset(preset, **over)
    if arch == "3pt" and base.d_model % 3:  # nanoGPT's d 128: two phases (N must divide d and the heads)
        d.update(n_phases=2)
    if arch == "hyperloop":
        d.update(n_layers=max(ModelConfig.from_preset(preset, **over).n_layers, 3), n_begin=1, n_end=1, n_loops=2)
    return ModelConfig.from_preset(preset, **d)


class GPT2Block(nn.Module):
    """nanoGPT's block: LayerNorm, causal attention (SDPA), GELU MLP of 4·d."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln1, self.ln2, self.h = nn.LayerNorm(d), nn.LayerNorm(d), h
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(nn.Module):
    def __init__(self, vocab=256, d=128, h=4, layers=4, T=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(GPT2Block(d, h) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1), y.flatten())


def make_step(model: nn.Module, batch: int, seq: int, vocab: int, loss_of=None):
    torch.manual_seed(0)
    opt = make_optimizer(model, TrainConfig())
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    loss_of = loss_of or model_loss(model)
    times = {"fwd": [], "bwd": []}

    def step():
        t0 = time.perf_counter()
        loss = loss_of(x, y)
        t1 = time.perf_counter()
        loss.backward()
        times["fwd"].append(t1 - t0)
        times["bwd"].append(time.perf_counter() - t1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, times


class Capture(TorchDispatchMode):
    """Every matmul and attention call of a step, with its (detached) inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in FLOOR_OPS:
            keep = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a
            self.calls.append((func, [keep(a) for a in args], {k: keep(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def floor_of(step) -> callable:
    with Capture() as cap:
        step()
    calls = cap.calls

    def floor():
        with torch.no_grad():
            for func, args, kwargs in calls:
                func(*args, **kwargs)

    return floor, len(calls)


def top_ops(step, n: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / 3e3, e.count // 3) for e in rows]


def model_loss(model: nn.Module):
    """(x, y) -> loss: a phaseloop model's ``.loss``, or the GPT-2 model's return value."""
    return (lambda x, y: model(x, y)) if isinstance(model, GPT2) else (lambda x, y: model(x, y).loss)


@torch.compile
def _rms_norm(x, weight, eps: float):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@torch.compile
def _rope_qk(q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def compiled(model: nn.Module, mode: str):
    """(model, loss function) with ``mode`` applied from outside, as the trainer does."""
    if mode == "model":
        return model, torch.compile(model_loss(model))
    for m in model.modules():
        if mode == "block" and isinstance(m, (Block, GPT2Block)):
            m.forward = torch.compile(m.forward)
        elif mode == "pieces" and isinstance(m, RMSNorm):
            m.forward = lambda x, m=m: _rms_norm(x, m.weight, m.eps)
        elif mode == "pieces" and isinstance(m, Attention):
            m.rotate = _rope_qk
    return model, model_loss(model)


def compile_table(args) -> None:
    """Eager vs compiled training step per shape and arch, interleaved medians."""
    mode = args.compile
    print(f"compile {mode}")
    print(f"{'shape':<11}{'arch':<10}{'eager':>8}{'compiled':>9}{'ratio':>7}{'compile s':>10}{'break-even':>11}"
          f"{'floor':>7}{'eager/floor':>12}{'compiled/floor':>15}")
    for shape in args.shapes:
        _, _, batch, seq = SHAPES[shape]
        builders = {arch: lambda a=arch, shape=shape: build_model(config(shape, a)) for arch in args.archs}
        if shape == "nanogpt":
            builders["gpt2"] = GPT2
        fns, first = {}, {}
        for name, build in builders.items():
            torch.manual_seed(0)
            model, twin = build(), build()
            twin.load_state_dict(model.state_dict())
            vocab = 256 if isinstance(model, GPT2) else model.cfg.vocab_size
            fns[name], _ = make_step(model, batch, seq, vocab)
            fns[name + ":floor"], _ = floor_of(fns[name])
            twin, loss_of = compiled(twin, mode)
            fns[name + ":compiled"], _ = make_step(twin, batch, seq, vocab, loss_of=loss_of)
            t0 = time.perf_counter()
            fns[name + ":compiled"]()  # compiles forward and backward
            first[name] = time.perf_counter() - t0
        t = time_interleaved(fns, warmup=2, rounds=args.rounds, reps=2)
        for name in builders:
            e, c, f = t[name], t[name + ":compiled"], t[name + ":floor"]
            cost = first[name] - e
            even = f"{cost / (e - c):>11.0f}" if e > c else f"{'never':>11}"
            print(f"{shape:<11}{name:<10}{1e3 * e:>8.1f}{1e3 * c:>9.1f}{c / e:>7.3f}{cost:>10.1f}{even}"
                  f"{1e3 * f:>7.1f}{e / f:>12.2f}{c / f:>15.2f}")
        if "gpt2" in builders and "rope" in builders:
            print(f"{shape:<11}rope/gpt2 step: eager {t['rope'] / t['gpt2']:.3f}, "
                  f"compiled ({mode}) {t['rope:compiled'] / t['gpt2:compiled']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=0, help="also print the top N operators per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", choices=("model", "block", "pieces"),
                    help="eager vs the step compiled this way (instead of the floor table)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step, medians of "
          f"{args.rounds} interleaved rounds")
    if args.compile:
        compile_table(args)
        return 0
    print(f"{'shape':<11}{'arch':<10}{'params':>8}{'step':>8}{'floor':>8}{'step/floor':>11}{'fwd':>7}{'bwd':>7}"
          f"{'calls':>6}")
    for shape in args.shapes:
        _, _, batch, seq = SHAPES[shape]
        fns, meta = {}, {}
        for arch in args.archs:
            cfg = config(shape, arch)
            torch.manual_seed(0)
            model = build_model(cfg)
            step, times = make_step(model, batch, seq, cfg.vocab_size)
            floor, n = floor_of(step)
            fns[arch], fns[arch + ":floor"] = step, floor
            meta[arch] = (sum(p.numel() for p in model.parameters()), times, n, step)
        if shape == "nanogpt":
            g = GPT2()
            step, times = make_step(g, batch, seq, 256)
            floor, n = floor_of(step)
            fns["gpt2"], fns["gpt2:floor"] = step, floor
            meta["gpt2"] = (sum(p.numel() for p in g.parameters()), times, n, step)
        t = time_interleaved(fns, warmup=2, rounds=args.rounds, reps=2)
        for name, (params, times, n, _step) in meta.items():
            fwd, bwd = statistics.median(times["fwd"][-args.rounds:]), statistics.median(times["bwd"][-args.rounds:])
            print(f"{shape:<11}{name:<10}{params / 1e6:>7.2f}M{1e3 * t[name]:>8.1f}{1e3 * t[name + ':floor']:>8.1f}"
                  f"{t[name] / t[name + ':floor']:>11.2f}{1e3 * fwd:>7.1f}{1e3 * bwd:>7.1f}{n:>6}")
        if "gpt2" in meta and "rope" in meta:
            print(f"{shape:<11}rope/gpt2 step {t['rope'] / t['gpt2']:.3f}")
        for arch, base in (("3pt", "rope"), ("hyperloop", "rope"), ("universal", "rope")):
            if arch in t and base in t:
                print(f"{shape:<11}{arch}/{base} step {t[arch] / t[base]:.3f}")
        if args.top:
            for name, (_, _, _, step) in meta.items():
                print(f"  top operators, {shape} {name} (self CPU ms/step, calls):")
                for key, ms, count in top_ops(step, args.top):
                    print(f"    {key:<48}{ms:>8.2f}{count:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
