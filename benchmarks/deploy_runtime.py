"""The ExecuTorch rows of bench_deploy.py: every architecture as a ``.pte`` (XNNPACK; fp32,
int8, int4) beside phaseloop eager fp32 on the same weights, measured where the model runs.

Per row (a preset at a shape) and engine (``eager``: phaseloop's DecoderLM with its KVCache,
the path of ``phaseloop generate``; ``fp32`` / ``int8`` / ``int4``: the file, in
ExecuTorch's Python runtime, UT + ACT through its step methods; ``fp32-forward``, asked for
by name: the fp32 file through ``forward`` only, every ACT step, as ExecuTorch's C++ runner
calls it):

* the ``.pte`` bytes, and for int8 / int4 the bytes its quantised layers take in it over
  their fp32 bytes (the two files differ only there: ``fp32 size - q size`` is what
  quantising saved on those layers);
* peak RSS of a fresh process that loads the engine, prefills and decodes (VmHWM), and how
  much of it the engine added over the process after its imports (torch, phaseloop; the
  libraries a first forward maps in count as the engine's);
* batch-1 prefill tokens/s (one call of ``--prompt`` tokens) and decode tokens/s
  (``--new`` steps of one token after it), with ``--threads`` threads in every engine;
* the equality the export was checked with: fp32 max |logits - phaseloop's| over a prefill
  of 8 and 16 decode steps; int8 / int4 the relative loss difference from the
  dequantised reference (the torchao model, eager) on random tokens.

Every engine runs in its own process, round-robin over rows and engines for ``--rounds``
rounds (load drift hits them alike); the median is reported. Random weights (seeded; speed
and bytes do not depend on them). Exports are cached in ``--cache`` (a build step: slow,
minutes per model on a loaded 2-core machine, and no timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from phaseloop import ModelConfig, build_model
from phaseloop.inference import decode_layout
from phaseloop.kvcache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy_engines import peak_rss, rss_now

HERE = Path(__file__).resolve()
ENGINES = ("eager", "fp32", "int8", "int4")
BITS = {"fp32": None, "int8": 8, "int4": 4}
# the fp32 file through its forward only, as ExecuTorch's C++ runner calls it (not a default engine:
# it differs from fp32 only for UT + ACT, whose step methods PteModel runs otherwise)
FORWARD = "fp32-forward"


def _file(engine: str) -> str:
    """The exported file an engine runs (fp32-forward: the fp32 one)."""
    return "fp32" if engine == FORWARD else engine
# the Hyperloop paper's family (d 128 presets; bench_hyperloop.py's d 512) and the others
PAPER = ("transformer-small", "transformer-small-L4", "mhc-small", "looped-small", "hyperloop-small")
OTHERS = ("rope-small", "3pt-small", "universal-small", "universal-act-small")
ROWS = PAPER + OTHERS
WIDE = {"paper": dict(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1408),
        "other": dict(d_model=576, n_heads=12, n_kv_heads=6, d_ff=1536)}  # N = 3 divides 576, 12, 6


def config(row: str, shape: str) -> ModelConfig:
    """``transformer-small-L4``: the Transformer with Hyperloop-small's 4 unique layers
    (matched parameters; ``transformer-small``, 8 layers, matches its depth); ``rope-tiny-L1``:
    one layer (the smoke test's)."""
    preset, over = (row[:-3], {"n_layers": int(row[-1])}) if row[-3:-1] == "-L" else (row, {})
    if shape == "wide":
        over.update(WIDE["paper" if row in PAPER else "other"])
    return ModelConfig.from_preset(preset, **over)


def model(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def _eager_logits(m, x, prompt=8):
    cache = KVCache()
    return torch.cat([m(x[:, :prompt], cache=cache).logits,
                      *(m(x[:, t:t + 1], cache=cache).logits for t in range(prompt, x.shape[1]))], 1)


def export(row: str, shape: str, engine: str, cache_dir: Path, seed: int = 0, backend: str = "xnnpack") -> dict:
    """Export (or reuse) one file; its record: bytes, export seconds, the equality check."""
    from phaseloop.deploy import pte
    from phaseloop.deploy.program import metadata, prepare
    from phaseloop.deploy.runtime import PteModel

    path = cache_dir / f"{row}-{shape}-{engine}.pte"
    rec_path = path.with_suffix(".json")
    cfg = config(row, shape)
    if path.is_file() and rec_path.is_file():
        rec = json.loads(rec_path.read_text())
        if rec.get("config") == cfg.to_dict() and rec.get("backend", "xnnpack") == backend:
            return rec
    with torch.no_grad():
        eager = model(cfg, seed)
        x = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
        want = _eager_logits(eager, x)
        program = prepare(model(cfg, seed))
        quantized = pte.quantize_linears(program, BITS[engine]) if BITS[engine] else []
        ref = torch.cat([program(x[:, :8], torch.arange(8)),
                         *(program(x[:, t:t + 1], torch.tensor([t])) for t in range(8, 24))], 1)
        t0 = time.perf_counter()
        data = pte.lower(program, metadata(program), backend)
        export_s = time.perf_counter() - t0
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    runner = PteModel(path)
    got = torch.cat([runner(x[:, :8], 0), *(runner(x[:, t:t + 1], t) for t in range(8, 24))], 1)

    def ce(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).item()

    rec = {"row": row, "shape": shape, "engine": engine, "backend": backend, "config": cfg.to_dict(),
           "bytes": len(data),
           "params": sum(p.numel() for p in eager.parameters()), "export_s": round(export_s, 1),
           "quantized_fp32_bytes": sum(4 * eager.get_submodule(n[len("model."):]).weight.numel()
                                       for n in quantized),
           "max_abs_vs_phaseloop": (got - want).abs().max().item(),
           "max_abs_vs_reference": (got - ref).abs().max().item(),
           "loss_rel_vs_reference": abs(ce(got) / ce(ref) - 1)}
    rec_path.write_text(json.dumps(rec, indent=1))
    return rec


def executorch_version() -> str:
    from importlib.metadata import version

    return version("executorch")


def child(spec: dict) -> dict:
    """One engine in this (fresh) process: load, prefill ``prompt`` tokens, decode ``new``."""
    torch.set_num_threads(spec["threads"])
    torch.set_grad_enabled(False)
    cfg = ModelConfig.from_dict(spec["config"])
    tokens = torch.randint(0, cfg.vocab_size, (1, spec["prompt"] + spec["new"]),
                           generator=torch.Generator().manual_seed(2))
    P = spec["prompt"]
    if spec["engine"] == "eager":
        base = rss_now()
        m = model(cfg, spec["seed"])
        decode_layout(m)  # as `phaseloop generate` lays it out

        def run(x, start, cache):
            return m(x, cache=cache).logits
        new_cache = lambda: KVCache(capacity=P + spec["new"])
    else:
        from phaseloop.deploy.runtime import PteModel

        base = rss_now()
        m = PteModel(spec["path"], threads=spec["threads"], adaptive=spec["engine"] != FORWARD)

        def run(x, start, cache):
            return m(x, start)
        new_cache = lambda: None
    run(tokens[:, :P], 0, new_cache())  # warm-up
    t0 = time.perf_counter()
    cache = new_cache()
    run(tokens[:, :P], 0, cache)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in range(P, P + spec["new"]):
        run(tokens[:, t:t + 1], t, cache)
    decode_s = time.perf_counter() - t0
    peak = peak_rss()
    return {"prefill_tok_s": P / prefill_s, "decode_tok_s": spec["new"] / decode_s,
            "peak_rss": peak, "engine_rss": peak - base}


def measure(items: list[dict], rounds: int, threads: int, prompt: int, new: int) -> dict:
    """(row, shape, engine) -> the medians over ``rounds`` fresh processes, interleaved."""
    samples: dict = {}
    for _ in range(rounds):
        for it in items:
            spec = {**it, "threads": threads, "prompt": prompt, "new": new}
            r = subprocess.run([sys.executable, str(HERE), "--child", json.dumps(spec)], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{it['row']} {it['engine']}: {r.stderr.strip().splitlines()[-1:]}")
            out = json.loads(r.stdout.strip().splitlines()[-1])
            samples.setdefault((it["row"], it["shape"], it["engine"]), []).append(out)
    return {k: {m: statistics.median(s[m] for s in v) for m in v[0]} for k, v in samples.items()}


def _rows(rows, shapes, engines, cache: Path, results: dict, backend: str = "xnnpack") -> list[dict]:
    out = []
    for row in rows:
        for shape in shapes:
            eager = results.get((row, shape, "eager"))
            fp32 = export(row, shape, "fp32", cache, backend=backend) if "fp32" in engines else None
            for engine in engines:
                rec = export(row, shape, _file(engine), cache, backend=backend) if engine != "eager" else None
                m = results.get((row, shape, engine), {})
                r = {"row": row, "shape": shape, "engine": engine, **m,
                     "params": (rec or fp32 or {}).get("params"), "pte_bytes": rec and rec["bytes"],
                     "decode_vs_eager": m and eager and m["decode_tok_s"] / eager["decode_tok_s"]}
                if rec and rec["quantized_fp32_bytes"] and fp32:  # the two files differ only in those layers
                    q = rec["quantized_fp32_bytes"] - (fp32["bytes"] - rec["bytes"])
                    r["quantized_vs_fp32"] = q / rec["quantized_fp32_bytes"]
                if rec:
                    r["check"] = (f"max|d| {rec['max_abs_vs_phaseloop']:.1e}" if _file(engine) == "fp32"
                                  else f"dloss/loss {rec['loss_rel_vs_reference']:.1e}")
                    r["export_s"] = rec["export_s"]
                out.append(r)
    return out


def _fmt(v, spec):
    return "" if v in (None, {}) else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| model | shape | params | engine | .pte MB | q layers / fp32 | peak RSS MB | engine RSS MB | "
            "prefill tok/s | decode tok/s | decode / eager | check |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        mb = lambda b: _fmt(b and b / 1e6, ".2f")
        lines.append(f"| {r['row']} | {r['shape']} | {_fmt(r['params'] and r['params'] / 1e6, '.2f')}M | "
                     f"{r['engine']} | {mb(r['pte_bytes'])} | {_fmt(r.get('quantized_vs_fp32'), '.3f')} | "
                     f"{mb(r.get('peak_rss'))} | {mb(r.get('engine_rss'))} | {_fmt(r.get('prefill_tok_s'), '.0f')} | "
                     f"{_fmt(r.get('decode_tok_s'), '.0f')} | {_fmt(r.get('decode_vs_eager'), '.2f')} | "
                     f"{r.get('check', '')} |")
    return "\n".join(lines)


def matched(rows: list[dict]) -> str:
    """Hyperloop-small against the Transformer at matched depth and at matched parameters:
    the ratios of .pte bytes, the engine's RSS and decode tokens/s, per shape and engine."""
    by = {(r["row"], r["shape"], r["engine"]): r for r in rows}
    lines = ["| shape | engine | vs | params | .pte bytes | engine RSS | decode tok/s |", "|" + "---|" * 7]
    for (row, shape, engine), h in by.items():
        if row != "hyperloop-small":
            continue
        for other, what in (("transformer-small", "matched depth"), ("transformer-small-L4", "matched params")):
            t = by.get((other, shape, engine))
            if t is None:
                continue
            def ratio(k, h=h, t=t):
                return _fmt(h.get(k) and t.get(k) and h[k] / t[k], ".2f")

            lines.append(f"| {shape} | {engine} | {other} ({what}) | {ratio('params')} | {ratio('pte_bytes')} | "
                         f"{ratio('engine_rss')} | {ratio('decode_tok_s')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``bench_deploy.py executorch [options]``; ``--child SPEC``: one engine (a measuring process)."""
    p = argparse.ArgumentParser(prog="bench_deploy.py executorch", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--shapes", default="small,wide")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}, {FORWARD}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64, help="prefill tokens")
    p.add_argument("--new", type=int, default=32, help="decode steps after the prompt")
    p.add_argument("--cache", default="runs/bench_deploy", help="the exported files (reused when their config matches)")
    p.add_argument("--export-only", action="store_true", help="build the files, measure nothing")
    p.add_argument("--backend", choices=("xnnpack", "portable"), default="xnnpack",
                   help="portable: ExecuTorch's portable kernels (the smoke test: faster to export)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    rows, shapes, engines, cache = a.rows.split(","), a.shapes.split(","), a.engines.split(","), Path(a.cache)
    items = []
    for row in rows:
        for shape in shapes:
            cfg = config(row, shape).to_dict()
            for engine in engines:
                rec = export(row, shape, _file(engine), cache, backend=a.backend) if engine != "eager" else None
                print(f"exported {row} {shape} {engine}" + (f": {rec['bytes'] / 1e6:.2f} MB, {rec['export_s']} s"
                                                            if rec else ""), flush=True)
                items.append({"row": row, "shape": shape, "engine": engine, "config": cfg, "seed": 0,
                              "path": str(cache / f"{row}-{shape}-{_file(engine)}.pte")})
    if a.export_only:
        return 0
    results = measure(items, a.rounds, a.threads, a.prompt, a.new)
    out = _rows(rows, shapes, engines, cache, results, a.backend)
    print(f"\nExecuTorch {executorch_version()} ({a.backend}), {a.threads} thread(s), prefill {a.prompt} tokens, "
          f"decode {a.new}; median of {a.rounds} interleaved processes per engine\n")
    print(table(out))
    print("\nHyperloop-small / the Transformer (the paper's memory claim)\n")
    print(matched(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
