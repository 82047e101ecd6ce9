"""Deployment measured where the model runs (issue 40): per engine, the bytes its weights
occupy, its peak resident memory, batch-1 decode and prefill tokens/s and, beside each
decode figure, its floor: the bytes one decode step reads divided by this machine's
memory bandwidth, measured in the same run (a 256 MiB copy and a read-only sum; the
faster of the two, so the floor is the strictest; probed at the start of every round, and
"of floor" is the median over rounds of decode / floor within a round). Each engine runs in
its own process (its RSS is its own), the processes interleaved round by round, medians
reported.

Then (deploy_kernels.py) one matrix product per kernel and activation dtype, the table
behind the choice of kernels.

Engines (deploy_engines.ENGINES, a table a second family adds to: deploy_runtime.py):
phaseloop fp32 / int8 (per row) / int4 (group 32) through ``--quantized``, transformers'
``LlamaForCausalLM.generate`` on the ``export --format llama`` folder and llama.cpp
(llama-cpp-python, where installed) on ``export --format gguf`` f32 / q8_0, and phaseloop's
own ``export --format executorch`` files (fp32 / int8 / int4, the head too with ``--head``;
XNNPACK; where executorch is installed) decoded as ``phaseloop generate FILE.pte`` decodes them: the same rope weights.
Shapes: rope-small trained briefly (the loss column: mean cross-entropy over validation
windows, each engine computing it), the rope-123m shape with random weights
(speed only), and the Hyperloop paper's memory claim at matched depth: transformer-small
against hyperloop-small (8 applied layers each). The greedy tokens of every engine are
compared with phaseloop fp32's (llama.cpp's equality check, which CI cannot run).

    python benchmarks/bench_deploy.py                       # everything, ~35 min on 2 cores (exports ~12)
    python benchmarks/bench_deploy.py --shapes rope-123m --engines phaseloop-fp32,phaseloop-int4
    python benchmarks/bench_deploy.py --smoke               # rope-tiny, one round (the test)

``executorch`` (deploy_runtime.py, a family of its own): every architecture as a ``.pte``,
XNNPACK fp32 / int8 / int4, beside phaseloop eager fp32 on the same weights; the Hyperloop
paper's memory claim as Hyperloop-small against the Transformer at matched depth and at
matched parameters. Exports are a build step, cached in ``--cache``:

    python benchmarks/bench_deploy.py executorch --export-only            # build every file
    flock /tmp/phaseloop-bench.lock python benchmarks/bench_deploy.py executorch        # the whole table
    flock /tmp/phaseloop-bench.lock python benchmarks/bench_deploy.py executorch --rows hyperloop-small \
        --shapes small --engines eager,fp32,int4 --rounds 1                              # one row, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import deploy_engines  # noqa: E402
import deploy_kernels  # noqa: E402

ENGINES = deploy_engines.ENGINES
# engine families with their own program: ``bench_deploy.py FAMILY ...`` runs FAMILY's main
FAMILIES: dict = {}
try:  # the ExecuTorch rows (benchmarks/deploy_runtime.py)
    import deploy_runtime

    FAMILIES["executorch"] = deploy_runtime.main
except ImportError:
    pass
# shape -> how its run is made: preset, --set fields, train steps (1: random weights), engines
SHAPES = {
    "rope-small": dict(preset="rope-small", sets={}, steps=400, loss=True, engines=None),
    "rope-123m": dict(preset="rope-123m", sets={"vocab_size": 32000}, steps=1, loss=False, engines=None),
    "transformer-small": dict(preset="transformer-small", sets={}, steps=1, loss=False,
                              engines=("phaseloop-fp32", "phaseloop-int4")),
    "hyperloop-small": dict(preset="hyperloop-small", sets={}, steps=1, loss=False,
                            engines=("phaseloop-fp32", "phaseloop-int4")),
    "rope-tiny": dict(preset="rope-tiny", sets={}, steps=20, loss=True, engines=None),
    # UT + ACT: eager against --compile, whose graphs per step stop each token where it halts
    "universal-act-small": dict(preset="universal-act-small", sets={}, steps=1, loss=False,
                                engines=("phaseloop-fp32", "phaseloop-compiled-fp32")),
}
DEFAULT_SHAPES = ("rope-small", "rope-123m", "transformer-small", "hyperloop-small")


def membw(threads: int, mib: int = 256, reps: int = 7) -> dict:
    """GB/s: a copy (bytes read + written / s) and a read-only sum (bytes read / s), medians."""
    import torch

    torch.set_num_threads(threads)
    n = mib * 2 ** 20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    src.sum()
    copy, read = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        read.append(time.perf_counter() - t0)
    b = n * 4 / 1e9
    return {"copy_gb_s": 2 * b / statistics.median(copy), "read_gb_s": b / statistics.median(read)}


def child(engine: str, job_file: str) -> int:
    """Run one engine (or the bandwidth probe) in this process; print its JSON."""
    import torch

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(job["threads"])
    if engine == "membw":
        print(json.dumps(membw(job["threads"])))
        return 0
    if engine == "kernels":
        print(json.dumps(deploy_kernels.kernel_table(**job.get("kernels", {}))))
        return 0
    if engine == "layout":
        print(json.dumps(deploy_kernels.layout_table(**job.get("layout", {}))))
        return 0
    if job.get("windows"):
        from safetensors.torch import load_file

        job["windows"] = load_file(job["windows"])["windows"]
    base = deploy_engines.peak_rss()
    res = ENGINES[engine][0](job)
    res.setdefault("peak_rss", deploy_engines.peak_rss())
    res["rss_at_start"] = base
    print(json.dumps(res))
    return 0


def _cli(argv: list) -> None:
    from phaseloop.cli import main

    code = main([str(a) for a in argv])
    if code != 0:
        raise SystemExit(f"bench_deploy: `phaseloop {' '.join(map(str, argv))}` failed ({code})")


def setup(shape: str, work: Path, engines: list[str], threads: int, quick: bool) -> dict:
    """The run (trained or random), its quantised files, Llama folder and GGUF files, the
    prompt, the prefill tokens and (loss shapes) the validation windows; the job of every child."""
    import torch
    from safetensors.torch import save_file

    from phaseloop.engine.checkpoint import load_run, run_corpus
    from phaseloop.lm.train import eval_set

    spec, root = SHAPES[shape], work / shape
    run = root / "run"
    torch.set_num_threads(threads)
    if not (run / "checkpoint").is_dir():
        data = "shakespeare" if (Path(os.environ.get("PHASELOOP_DATA_DIR", "/nonexistent")) /
                                 "tinyshakespeare").is_dir() else "stdlib"
        sets = [a for k, v in spec["sets"].items() for a in ("--set", f"{k}={v}")]
        random = spec["steps"] == 1  # one step at a tiny learning rate: the init, for speed only
        shape_args = ["--batch-size", 1, "--seq-len", 32, "--lr", 1e-9, "--warmup", 1] if random else \
            ["--batch-size", 16, "--warmup", 20]
        _cli(["train", "--preset", spec["preset"], *sets, "--data", data, "--steps", spec["steps"], *shape_args,
              "--eval-every", 10 ** 6, "--ckpt-every", 10 ** 6, "--eval-windows", 2, "--compile", "off",
              "--quiet", "--out", run])
    model, run_cfg = load_run(run)
    cfg = model.cfg
    job = {"run": str(run), "threads": threads, "quant": {}, "gguf": {},  # n_layers: the KV slots a token writes
           "cfg": {"n_layers": len(model.trunk.cache_slots()), "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim}}
    for name, bits, group in (("int8", 8, -1), ("int4", 4, 32), ("int8-head", 8, -1), ("int4-head", 4, 32)):
        head = ["--head"] if name.endswith("-head") else []
        path = run / f"quant-w{bits}-g{group}-rtn{'-head' * bool(head)}.safetensors"
        if {f"phaseloop-{name}", f"phaseloop-compiled-{name}"} & set(engines) and not path.is_file():
            _cli(["quantize", run, "--bits", bits, "--group-size", group, "--windows", 2, "--device", "cpu", *head])
        job["quant"][name] = str(path)
    if cfg.arch == "rope" and any("llama" in ENGINES[e][2] for e in engines) and not (root / "llama").is_dir():
        _cli(["export", run, "--format", "llama", "--out", root / "llama"])
    job["llama"] = str(root / "llama")
    for outtype in ("f32", "q8_0"):
        path = root / f"model-{outtype}.gguf"
        if cfg.arch == "rope" and any("gguf" in ENGINES[e][2] for e in engines) and not path.is_file():
            _cli(["export", run, "--format", "gguf", "--outtype", outtype, "--out", path])
        job["gguf"][outtype] = str(path)
    corpus = run_corpus(run, run_cfg)
    seq = run_cfg["train"].get("seq_len") or cfg.max_seq_len
    _, val = corpus.split(0.1, seq + 1)
    ids = [int(t) for t in val[: 4 * cfg.max_seq_len]]
    job["new_tokens"] = 16 if quick else 48
    job["prompt"] = ids[:16]
    job["prefill_ids"] = ids[: min(256, cfg.max_seq_len - 8) if not quick else 32]
    job["cfg"].update(d_model=cfg.d_model, tied=cfg.tie_embeddings)
    # the programs' cache: the longest sequence an engine feeds them (the prefill, a window)
    max_len = max(len(job["prefill_ids"]), len(job["prompt"]) + job["new_tokens"], seq if spec["loss"] else 0)
    job["pte"] = {}
    for kind, bits in (("fp32", []), ("int8", ["--bits", 8]), ("int4", ["--bits", 4]),
                       ("int8-head", ["--bits", 8, "--head"]), ("int4-head", ["--bits", 4, "--head"])):
        path = root / f"model-{kind}-{max_len}.pte"
        if f"executorch-{kind}" in engines and not path.is_file():
            _cli(["export", run, "--format", "executorch", "--max-seq-len", max_len, *bits, "--out", path])
        job["pte"][kind] = str(path)
    if spec["loss"]:
        windows, _ = eval_set(corpus, val, seq, 4 if quick else 16, run_cfg["train"])
        save_file({"windows": windows.contiguous()}, root / "windows.safetensors")
        job["windows"] = str(root / "windows.safetensors")
    return job


def spawn(engine: str, job: dict, work: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=work, delete=False) as f:
        json.dump(job, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "MKL_NUM_THREADS": str(job["threads"])}
    try:
        r = subprocess.run([sys.executable, str(Path(__file__)), "--child", engine, "--job", f.name],
                           capture_output=True, text=True, env=env, timeout=1800)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise SystemExit(f"bench_deploy: engine {engine} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _med(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def report(results: dict, bw: list[dict], out_json: str | None) -> None:
    copy, read = statistics.median(b["copy_gb_s"] for b in bw), statistics.median(b["read_gb_s"] for b in bw)
    gbs = max(copy, read)
    print(f"\nmemory bandwidth (medians of {len(bw)} runs): copy {copy:.2f} GB/s (read + write), "
          f"read-only sum {read:.2f} GB/s; floors use {gbs:.2f} GB/s")
    summary = {"bandwidth": {"copy_gb_s": copy, "read_gb_s": read, "floor_gb_s": gbs}, "shapes": {}}
    for shape, engines in results.items():
        print(f"\n### {shape}\n")
        print("| engine | weight MB | RSS MB: running (peak) | decode tok/s | floor tok/s | of floor | step ms "
              "(matmuls) | prefill tok/s | loss | greedy = fp32 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        ref = engines.get("phaseloop-fp32")  # None: not in this run, nothing to compare with
        rows = {}
        for engine, runs in engines.items():
            row = {k: _med(runs, k) for k in ("weight_bytes", "peak_rss", "rss_run", "decode_tok_s", "prefill_tok_s",
                                                "loss", "bytes_per_token", "step_ms", "matmul_ms")}
            row["floor_tok_s"] = gbs * 1e9 / row["bytes_per_token"]
            # of its floor round by round (the bandwidth probe opens each round, the engine runs
            # minutes later at most): a drift of the machine between rounds moves both alike
            row["of_floor"] = statistics.median(
                r["decode_tok_s"] * r["bytes_per_token"] / (max(b["copy_gb_s"], b["read_gb_s"]) * 1e9)
                for r, b in zip(runs, bw))
            row["same_tokens"] = None if ref is None else all(a.get("tokens") == b.get("tokens")
                                                              for a, b in zip(runs, ref))
            rows[engine] = row
            step = f"{row['step_ms']:.2f} ({row['matmul_ms']:.2f})" if row["matmul_ms"] else ""
            loss = f"{row['loss']:.4f}" if row["loss"] is not None else ""
            print(f"| {engine} | {row['weight_bytes'] / 1e6:.2f} | {row['rss_run'] / 2 ** 20:.0f} "
                  f"({row['peak_rss'] / 2 ** 20:.0f}) | "
                  f"{row['decode_tok_s']:.1f} | {row['floor_tok_s']:.1f} | "
                  f"{row['of_floor']:.2f} | {step} | {row['prefill_tok_s']:.0f} | {loss} | "
                  f"{'-' if row['same_tokens'] is None else 'yes' if row['same_tokens'] else 'no'} |")
        fp32 = rows.get("phaseloop-fp32")
        if fp32:
            ratios = {f"{e} / phaseloop-fp32 decode": r["decode_tok_s"] / fp32["decode_tok_s"]
                      for e, r in rows.items() if e != "phaseloop-fp32"}
            ratios.update({f"{e} / phaseloop-fp32 weight bytes": r["weight_bytes"] / fp32["weight_bytes"]
                           for e, r in rows.items() if e.startswith("phaseloop-int")})
            print("\n" + "; ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
            rows["ratios"] = ratios
        compiles = {e: _med(runs, "compile_s") for e, runs in engines.items() if _med(runs, "compile_s")}
        if compiles:
            print("compile (once per process, not in tok/s): "
                  + "; ".join(f"{e} {v:.1f} s" for e, v in compiles.items()))
        summary["shapes"][shape] = rows
    if out_json:
        Path(out_json).write_text(json.dumps(summary, indent=2))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in FAMILIES:
        return FAMILIES[argv[0]](argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated; those that cannot run here "
                   "are skipped, saying why")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", help="folder for the runs and exports (default: a new temporary folder; "
                   "reused when given)")
    p.add_argument("--json", help="write the measured table here as JSON")
    p.add_argument("--no-kernels", action="store_true", help="skip the table of single products per kernel")
    p.add_argument("--smoke", action="store_true", help="rope-tiny, one round, few tokens (the test)")
    p.add_argument("--child"), p.add_argument("--job")
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.job)
    shapes = ["rope-tiny"] if args.smoke else args.shapes.split(",")
    rounds = 1 if args.smoke else args.rounds
    wanted = args.engines.split(",")
    for e in wanted:
        why = ENGINES[e][1]() if e in ENGINES else "no such engine"
        if why:
            print(f"skipped {e}: {why}")
    wanted = [e for e in wanted if e in ENGINES and ENGINES[e][1]() is None]
    if args.smoke:  # two of the ExecuTorch files and one compile: exports and compiles are the slow part
        wanted = [e for e in wanted if not e.startswith(("executorch-", "phaseloop-compiled-"))
                  or e in ("executorch-fp32", "executorch-int4", "phaseloop-compiled-fp32")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs, plan = {}, []
    for shape in shapes:
        engines = [e for e in wanted if SHAPES[shape]["engines"] is None or e in SHAPES[shape]["engines"]]
        t0 = time.perf_counter()
        jobs[shape] = setup(shape, work, engines, args.threads, args.smoke)
        print(f"setup {shape}: {time.perf_counter() - t0:.0f} s", flush=True)
        plan += [(shape, e) for e in engines]
    results = {s: {} for s in shapes}
    bw = []
    for r in range(rounds):
        order = plan[r % len(plan):] + plan[:r % len(plan)]  # a different engine first each round
        bw.append(spawn("membw", {"threads": args.threads}, work))
        for shape, engine in order:
            res = spawn(engine, jobs[shape], work)
            results[shape].setdefault(engine, []).append(res)
            print(f"round {r + 1} {shape} {engine}: decode {res['decode_tok_s']:.1f} tok/s, "
                  f"prefill {res['prefill_tok_s']:.0f} tok/s", flush=True)
    report(results, bw, args.json)
    if not args.no_kernels:
        small = {"shapes": [[256, 96]], "ms": [1, 16], "copies_mb": 8, "reps": 2} if args.smoke else {}
        deploy_kernels.print_kernels(spawn("kernels", {"threads": args.threads, "kernels": small}, work))
        layout = ({"preset": "rope-tiny", "batches": [1, 4], "steps": 2, "reps": 1} if args.smoke
                  else {"preset": "rope-123m"})
        deploy_kernels.print_layout(spawn("layout", {"threads": args.threads, "layout": layout}, work),
                                    layout["preset"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
