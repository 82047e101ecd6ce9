"""explore's load and latency targets (issue 26, "Fast"), measured side by side in one run:

* opening a run with 100,000 metric records: the first ``/api/runs/curves`` (whole file
  parsed, downsampled to 1,000 points a curve), then a poll after 100 more records
  (only the new bytes read); target: the first under 1 s;
* a ponder map of 256 tokens of a small UT+ACT model (universal-act-small at
  max_seq_len 256, one training step): ``/api/inside/analyze`` with the model loaded
  (a new prompt each round), and the cold first request that loads it; target: under 1 s.

Through Starlette's TestClient (the app's own code path, no socket). Medians of
``--rounds``. ``--smoke`` runs the smallest setting (tests/test_explore_runs.py).

    python benchmarks/bench_explore.py [--records 100000] [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _metrics(run: Path, n: int) -> None:
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"arch": "rope"}, "train": {"steps": n}}))
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, n + 1):
            if s % 100 == 0:
                f.write(json.dumps({"step": s, "val_loss": 3 - s / n, "val_ppl": 9.0, "val_bpb": 4.3,
                                    "val_tokens": 4096, "val_tokens_per_byte": 1.0, "elapsed_s": s * 0.01}) + "\n")
            else:
                f.write(json.dumps({"step": s, "loss": 3 - s / n, "lr": 3e-4, "grad_norm": 1.0, "tokens": 4096 * s,
                                    "tok_per_s": 1e5, "elapsed_s": s * 0.01}) + "\n")


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="smallest setting (1,000 records, 16 tokens, 1 round)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.records, args.tokens, args.rounds = 1000, 16, 1
    from starlette.testclient import TestClient

    from phaseloop.cli import main as cli
    from phaseloop.explore.app import create_app
    from phaseloop.explore.context import ServerContext

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "served"
        curves = []
        for r in range(args.rounds):  # a fresh server each round: the first open is cold
            _metrics(root / f"big{r}", args.records)
        client = TestClient(create_app(ServerContext.from_paths([root])))
        for r in range(args.rounds):
            q = {"root": "served", "path": f"big{r}"}
            first, body = _timed(lambda q=q: client.get("/api/runs/curves", params=q))
            with open(root / f"big{r}" / "metrics.jsonl", "a") as f:
                for s in range(args.records + 1, args.records + 101):
                    f.write(json.dumps({"step": s, "loss": 2.0, "lr": 3e-4, "elapsed_s": 1.0}) + "\n")
            poll, body2 = _timed(lambda q=q: client.get("/api/runs/curves", params=q))
            assert body2.json()["records"] == body.json()["records"] + 100
            curves.append((first, poll, len(body.content), len(body.json()["train"]["step"])))

        text = Path(tmp) / "corpus.txt"
        text.write_text(("the quick brown fox jumps over the lazy dog. " * 40 + "\n") * 30)
        run = root / "act"
        seq = max(args.tokens, 16)
        assert cli(["train", "--preset", "universal-act-small", "--set", f"max_seq_len={seq}", "--steps", "1",
                    "--batch-size", "1", "--eval-windows", "1", "--warmup", "1", "--quiet", "--data", str(text),
                    "--out", str(run)]) == 0
        words = "the quick brown fox jumps over the lazy dog and runs far away "
        prompts = [(words * 20)[r:r + args.tokens] for r in range(args.rounds + 1)]
        q = {"root": "served", "path": "act"}
        cold, _ = _timed(lambda: client.get("/api/inside/analyze", params={**q, "prompt": prompts[0]}))
        warm = []
        for p in prompts[1:]:
            dt, body = _timed(lambda p=p: client.get("/api/inside/analyze", params={**q, "prompt": p}))
            a = body.json()
            assert body.status_code == 200 and len(a["ponder"]) == args.tokens, body.text[:200]
            warm.append(dt)

    med = lambda xs: statistics.median(xs)
    print(f"open a run of {args.records:,} metric records (first /api/runs/curves, whole file): "
          f"{med([c[0] for c in curves]) * 1e3:.0f} ms, {curves[0][2] / 1e3:.0f} kB, "
          f"{curves[0][3]} points drawn of the training curve")
    print(f"poll after 100 more records (new bytes only): {med([c[1] for c in curves]) * 1e3:.1f} ms; "
          f"ratio first/poll {med([c[0] for c in curves]) / med([c[1] for c in curves]):.0f}x")
    print(f"ponder map of {args.tokens} tokens, universal-act-small (/api/inside/analyze, model loaded): "
          f"{med(warm) * 1e3:.0f} ms; cold (loading the model too): {cold * 1e3:.0f} ms")
    print(f"targets (issue 26): open < 1000 ms: {'met' if med([c[0] for c in curves]) < 1 else 'MISSED'}; "
          f"ponder map < 1000 ms: {'met' if med(warm) < 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
