"""`phaseloop serve` under load: generated tokens/s and p50 / p99 request latency at 1, 4, 8
and 16 concurrent clients, continuous batching on (``--max-batch 16``) against the
one-at-a-time server (``--max-batch 1``), on a small model and a d_model 512 one.

Both servers run side by side in this process (uvicorn threads on loopback, each with its
decode thread); the load of every (model, clients) cell alternates between them round by
round, so drift in machine load hits both alike. Clients are threads with their own HTTP
connection, each sending its next request as soon as the last one is answered (greedy,
``--max-tokens`` new tokens from a ~40-byte prompt). The models carry random weights:
decoding cost does not depend on what they learned, and every request runs its full
``max_tokens`` (a byte tokenizer has no end-of-text token). Latency is wall clock from the
request's sending to its last byte; tokens/s counts generated tokens over the cell's wall
clock.

    python benchmarks/bench_serve.py                       # the table in docs/serve.md
    python benchmarks/bench_serve.py --models small --clients 1,8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from phaseloop import ModelConfig, build_model
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.inference import decode_layout
from phaseloop.serve.loading import Served
from phaseloop.serve.runner import Background, Config

MODELS = {  # name -> (preset, overrides)
    "tiny": ("rope-tiny", {}),
    "small": ("rope-small", {}),
    "d512": ("rope-small", {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "d_ff": 1408,
                            "max_seq_len": 512}),
}
PROMPTS = ["the quick brown fox jumps over the lazy dog", "ROMEO: what light through yonder window breaks",
           "def main(argv):\n    return 0\n\nif __name__ ==", "In the beginning the Universe was created."]


def served(name: str) -> Served:
    preset, over = MODELS[name]
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset, **over)).eval()
    decode_layout(model)  # as serve's loader lays a run out
    tok = ByteTokenizer()
    return Served(model, name, lambda text: tok.encode(text).tolist(), tok.decode)


def load_cell(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` requests from ``clients`` threads; tokens/s, latencies, errors."""
    latencies, errors, tokens = [], 0, 0

    def client(k: int):
        nonlocal errors, tokens
        with httpx.Client(timeout=600) as http:
            for i in range(k, requests, clients):
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)],
                                                             "max_tokens": max_tokens, "temperature": 0})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors += 1
                else:
                    tokens += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "latencies": latencies, "errors": errors, "wall": wall}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small,d512", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=2, help="requests per client and cell (at least 8 a cell)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.clients.split(",")]
    print(f"# bench_serve: {args.max_tokens} new tokens a request, {args.rounds} rounds, torch threads "
          f"{args.threads}, batching --max-batch {args.max_batch} vs 1\n")
    print("| model | params | clients | server | tok/s | p50 latency (s) | p99 latency (s) | errors "
          "| batched / one at a time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = served(name)
        params = sum(t.numel() for t in model.model.parameters())
        cfg = {"batched": Config(port=0, max_batch=args.max_batch), "one at a time": Config(port=0, max_batch=1)}
        servers = {k: Background(model, c) for k, c in cfg.items()}
        try:
            for url in (s.url for s in servers.values()):  # warm up
                load_cell(url, 1, 1, 4)
            for c in levels:
                n = max(8, args.requests * c)
                cells = {k: [] for k in servers}
                for _ in range(args.rounds):
                    for k, s in servers.items():
                        cells[k].append(load_cell(s.url, c, n, args.max_tokens))
                tok_s = {k: statistics.median(r["tok_s"] for r in v) for k, v in cells.items()}
                for k, v in cells.items():
                    lat = [x for r in v for x in r["latencies"]]
                    ratio = f"{tok_s['batched'] / tok_s['one at a time']:.2f}x" if k == "batched" else ""
                    print(f"| {name} | {params / 1e6:.1f}M | {c} | {k} | {tok_s[k]:.0f} | {pct(lat, 0.5):.3f} | "
                          f"{pct(lat, 0.99):.3f} | {sum(r['errors'] for r in v)} | {ratio} |", flush=True)
        finally:
            for s in servers.values():
                s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
