"""Universal Transformer speed ratios, measured side by side in one run.

1. training step (forward + backward + AdamW) of a UT with T steps vs a stack of T
   distinct layers of the same width (target ~1.0: same compute, fewer parameters);
2. ACT overhead over fixed-T UT at the same max steps (target <= 10%). ACT is timed
   with the loop running all max steps (act_early_exit=False: the arithmetic cost
   alone); the early-exit time is printed too (at init positions halt after ~2 steps);
3. cached vs uncached greedy generation of 256 new tokens (target >= 5x), without and
   with ACT (cached ACT runs only the steps each new token needs: lazy step extension).

Usage: python benchmarks/bench_universal.py [--device cuda] [--d-model 192] [--steps 6]
       [--gen-only]
Timings interleave the configurations and report medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phaseloop import ModelConfig, build_model
from phaseloop.engine import TrainConfig, autocast, make_optimizer


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_timer(cfg, args, device):
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = make_optimizer(model, TrainConfig(lr=1e-4))
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)

    def run():
        sync(device)
        t0 = time.perf_counter()
        with autocast(device):
            out = model(x, x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    return run


def gen_timer(cfg, args, device, use_cache):
    torch.manual_seed(0)
    model = build_model(cfg).to(device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), device=device)

    def run():
        sync(device)
        t0 = time.perf_counter()
        with autocast(device):
            model.generate(prompt, args.new_tokens, temperature=0.0, use_cache=use_cache)
        sync(device)
        return time.perf_counter() - t0

    return run


def median_times(timers: dict, iters: int, warmup: int) -> dict:
    for _ in range(warmup):
        for f in timers.values():
            f()
    times = {k: [] for k in timers}
    for _ in range(iters):
        for k, f in timers.items():  # interleaved: load changes hit every config alike
            times[k].append(f())
    return {k: statistics.median(v) for k, v in times.items()}


def train_ratios(stack, ut, act_full, act_exit, args, device) -> None:
    T = args.steps
    tr = median_times({"stack": step_timer(stack, args, device), "ut": step_timer(ut, args, device),
                       "act": step_timer(act_full, args, device),
                       "act_exit": step_timer(act_exit, args, device)}, args.iters, 2)
    for k, v in tr.items():
        print(f"  train step {k:<9} {v * 1e3:9.1f} ms")
    print(f"UT(T={T}) / stack of {T} layers, train step:        {tr['ut'] / tr['stack']:.3f}  (target ~1.0)")
    print(f"ACT overhead over fixed-T UT (all {T} steps run): {100 * (tr['act'] / tr['ut'] - 1):+.1f}%  "
          f"(target <= 10%)")
    print(f"ACT with early exit / fixed-T UT (at init):      {tr['act_exit'] / tr['ut']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--steps", type=int, default=6, help="T")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--gen-iters", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's)")
    p.add_argument("--gen-only", action="store_true", help="only the generation ratios (3.)")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    T = args.steps
    common = dict(d_model=args.d_model, n_heads=args.n_heads, d_ff=4 * args.d_model, vocab_size=256,
                  max_seq_len=args.seq_len + args.new_tokens + 16)
    stack = ModelConfig(arch="rope", n_layers=T, **common)
    ut = ModelConfig(arch="universal", n_layers=1, n_steps=T, **common)
    act_full = ut.replace(act=True, act_max_steps=T, act_early_exit=False)
    act_exit = ut.replace(act=True, act_max_steps=T)
    print(f"device {device}, d_model {args.d_model}, T {T}, batch {args.batch} x {args.seq_len}, "
          f"threads {torch.get_num_threads()}")

    if not args.gen_only:
        train_ratios(stack, ut, act_full, act_exit, args, device)
    gen = median_times({"cached": gen_timer(ut, args, device, True),
                        "uncached": gen_timer(ut, args, device, False),
                        "act_cached": gen_timer(act_exit, args, device, True),
                        "act_uncached": gen_timer(act_exit, args, device, False)}, args.gen_iters, 1)
    for k, v in gen.items():
        print(f"  generate {args.new_tokens} {k:<12} {v:8.2f} s")
    print(f"generation of {args.new_tokens} tokens, uncached / cached:       "
          f"{gen['uncached'] / gen['cached']:.2f}x  (target >= 5x)")
    print(f"generation with ACT, uncached / cached:          {gen['act_uncached'] / gen['act_cached']:.2f}x  "
          f"(target >= 5x)")


if __name__ == "__main__":
    main()
