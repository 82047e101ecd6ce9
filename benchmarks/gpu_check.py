"""The GPU check (issue 13): one script a session lent a GPU runs as is, in under 8
minutes on one GPU; ``--smoke`` runs the same code on CPU at tiny shapes (CI) so it never
rots. It prints one table and writes JSON (``--out``).

Measured, interleaved and side by side (``common.time_interleaved``, medians):
  1. bf16 training tok/s, MFU and peak memory of rope-123m and 3pt-123m, eager and
     ``torch.compile``d (fused AdamW, SDPA with is_causal, TF32 for fp32 matmuls, as the
     trainer's steps);
  2. step ratios: 3PT / RoPE at N = 3 and N = 12, Hyperloop / Looped and mHC /
     Transformer at the 240m width;
  3. batch-1 greedy generation tok/s as ``phaseloop generate`` runs it (``inference.generate``:
     fp32 weights, no autocast, the KV cache preallocated), and on a looped model with an
     exit rule and with self-speculation (whose greedy tokens must equal the full depth's);
  4. a loss check: 50 steps on real text (the built-in ``stdlib`` corpus, bytes) of bf16
     autocast against full fp32 (TF32 off) from the same init and batches: both must learn
     (the last 10 losses' mean 0.5 nats under the first) and track each other within 5 %.

    python benchmarks/gpu_check.py                # on a GPU (targets: MFU >= 0.40 compiled, 3PT/RoPE <= 1.03)
    python benchmarks/gpu_check.py --smoke        # CPU, tiny shapes, a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_interleaved

from phaseloop import ModelConfig, build_model
from phaseloop.analysis.params import count_params
from phaseloop.data.corpus import load_corpus
from phaseloop.early_exit import parse_exit
from phaseloop.engine import TrainConfig, autocast, dist, make_optimizer, resolve_device
from phaseloop.engine.optim import tf32
from phaseloop.inference import Options, generate

FULL = dict(batch=16, seq=1024, gen=256, loss_preset="rope-small", loss_batch=16, loss_seq=256,
            rope="rope-123m", tpt="3pt-123m", looped="looped-240m", hyper="hyperloop-240m",
            plain="transformer-240m", mhc="mhc-240m", rounds=5, reps=2)
SMOKE = dict(batch=2, seq=32, gen=16, loss_preset="rope-tiny", loss_batch=2, loss_seq=32,
             rope="rope-tiny", tpt="3pt-tiny", looped="looped-tiny", hyper="hyperloop-tiny",
             plain="transformer-tiny", mhc="mhc-tiny", rounds=2, reps=1)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(cfg: ModelConfig, batch: int, seq: int, device, compile_backend: str | None = None):
    """One full training step as the trainer runs it (autocast forward, backward with TF32 on
    CUDA, clip, fused/foreach AdamW)."""
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = make_optimizer(model, TrainConfig())
    fwd = torch.compile(model, backend=compile_backend) if compile_backend else model
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step():
        with tf32(device.type == "cuda"):
            with autocast(device):
                loss = fwd(x, y).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    return step


def peak_mb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def throughput(s, device, backend, peak) -> list[dict]:
    rows = []
    for name in (s["rope"], s["tpt"]):
        cfg = ModelConfig.from_preset(name, max_seq_len=max(s["seq"], 64))
        fpt = count_params(cfg, s["seq"])["flops_per_token"]
        for mode in ("eager", "compiled"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            fn = step_fn(cfg, s["batch"], s["seq"], device, backend if mode == "compiled" else None)
            fn()  # compile / warm up
            warm = time.perf_counter() - t0
            sec = time_interleaved({"x": fn}, warmup=1, rounds=s["rounds"], reps=s["reps"])["x"]
            tps = s["batch"] * s["seq"] / sec
            rows.append({"model": name, "mode": mode, "step_ms": 1e3 * sec, "tok_per_s": tps,
                         "mfu": dist.mfu(tps, fpt, peak, 1), "peak_mb": peak_mb(device), "first_step_s": warm})
            del fn
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def ratios(s, device) -> dict:
    seq = s["seq"]
    pairs = {"3pt/rope N=3": ({}, s["tpt"], s["rope"]),
             "3pt/rope N=12": ({"n_phases": 12, "n_kv_heads": 12, "n_heads": 12}, s["tpt"], s["rope"]),
             "hyperloop/looped": ({}, s["hyper"], s["looped"]),
             "mhc/transformer": ({}, s["mhc"], s["plain"])}
    out = {}
    for name, (over, a, b) in pairs.items():
        if "N=12" in name and s is SMOKE:
            over = {"n_phases": 2, "n_kv_heads": 6}  # tiny: d 96 = 2 phases of 48
        extra = {k: v for k, v in over.items() if k != "n_phases"}
        ca = ModelConfig.from_preset(a, max_seq_len=max(seq, 64), **over)
        cb = ModelConfig.from_preset(b, max_seq_len=max(seq, 64), **extra)
        t = time_interleaved({"a": step_fn(ca, s["batch"], seq, device), "b": step_fn(cb, s["batch"], seq, device)},
                             warmup=1, rounds=s["rounds"], reps=s["reps"])
        out[name] = t["a"] / t["b"]
    return out


@torch.no_grad()
def generation(s, device) -> dict:
    out = {}
    for name, preset, rows in (("rope", s["rope"], {"full": Options(max_new_tokens=s["gen"])}),
                               ("looped", s["looped"], {
                                   "full": Options(max_new_tokens=s["gen"]),
                                   "exit": Options(max_new_tokens=s["gen"], exit=parse_exit("state:0.5")[0],
                                                   kv_fill="latest"),
                                   "speculative": Options(max_new_tokens=s["gen"], speculative=1)})):
        torch.manual_seed(0)
        cfg = ModelConfig.from_preset(preset, max_seq_len=max(s["gen"] + 16, 64))
        model = build_model(cfg).to(device).eval()
        prompt = torch.randint(0, cfg.vocab_size, (1, 16), device=device)
        generate(model, prompt, Options(max_new_tokens=4))  # warm up
        got = {row: generate(model, prompt, o) for row, o in rows.items()}
        for row, g in got.items():
            out[f"{name} {row}"] = {"tok_per_s": g.tokens_per_s, "mean_passes": g.mean_passes,
                                    **({"acceptance": g.acceptance} if g.acceptance is not None else {})}
        if "speculative" in got:
            out["looped speculative"]["greedy_equal"] = torch.equal(got["speculative"].tokens, got["full"].tokens)
    return out


def loss_check(s, device, steps: int = 50) -> dict:
    """bf16 autocast vs full fp32 from the same init and batches of real text (on CPU both are fp32)."""
    cfg = ModelConfig.from_preset(s["loss_preset"], max_seq_len=max(s["loss_seq"], 64))
    tokens = torch.from_numpy(load_corpus("stdlib").tokens[:2_000_000].astype("int64"))
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(tokens) - s["loss_seq"] - 1, (steps, s["loss_batch"]), generator=gen)
    data = [torch.stack([tokens[a:a + s["loss_seq"] + 1] for a in row.tolist()]) for row in starts]
    curves = {}
    for mode in ("bf16", "fp32"):
        torch.manual_seed(0)
        model = build_model(cfg).to(device)
        opt = make_optimizer(model, TrainConfig(lr=1e-3))
        losses = []
        for xy in data:
            xy = xy.to(device)
            ctx = autocast(device) if mode == "bf16" else torch.autocast(device.type, enabled=False)
            with ctx, tf32(mode == "bf16" and device.type == "cuda"):  # bf16 as trained, fp32 in full
                loss = model(xy[:, :-1], xy[:, 1:]).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        curves[mode] = losses
    diff = max(abs(a - b) / b for a, b in zip(curves["bf16"][-10:], curves["fp32"][-10:]))
    learns = all(sum(c[-10:]) / 10 < c[0] - 0.5 for c in curves.values())
    return {"bf16_first": curves["bf16"][0], "bf16_final": curves["bf16"][-1], "fp32_final": curves["fp32"][-1],
            "max_rel_diff_last10": diff, "learns": learns, "tracks": learns and diff < 0.05}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile-backend", default=None, help="default inductor (smoke: eager)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    device = resolve_device("cpu" if args.smoke and args.device == "auto" else args.device)
    backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    peak = dist.peak_flops(device, args.peak_tflops)
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "smoke": args.smoke, "peak_flops": peak,
           "throughput": throughput(s, device, backend, peak), "ratios": ratios(s, device),
           "generate": generation(s, device), "loss_check": loss_check(s, device)}
    res["seconds"] = time.perf_counter() - t0
    print(f"device {res['device']}, torch {res['torch']}, peak {peak or 0:.3g} FLOP/s")
    print(f"{'model':<18}{'mode':<10}{'step ms':>10}{'tok/s':>12}{'MFU':>8}{'peak MB':>10}{'1st step s':>12}")
    for r in res["throughput"]:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        mb = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
        print(f"{r['model']:<18}{r['mode']:<10}{r['step_ms']:>10.1f}{r['tok_per_s']:>12.0f}{mfu:>8}{mb:>10}"
              f"{r['first_step_s']:>12.1f}")
    for k, v in res["ratios"].items():
        print(f"step ratio {k:<20} {v:.3f}")
    for k, v in res["generate"].items():
        print(f"generate {k:<20} {v['tok_per_s']:>10.1f} tok/s" + "".join(
            f", {f} {v[f]:.3g}" if isinstance(v[f], float) else f", {f} {v[f]}" for f in v if f != "tok_per_s"))
    lc = res["loss_check"]
    print(f"bf16 vs fp32 after 50 steps on text: {lc['bf16_first']:.4f} -> {lc['bf16_final']:.4f} vs "
          f"{lc['fp32_final']:.4f} (max rel diff {lc['max_rel_diff_last10']:.4f}, learns {lc['learns']}); "
          f"{res['seconds']:.0f} s")
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
