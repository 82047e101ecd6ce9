"""The engines bench_deploy.py measures, one function each: ``job`` (a dict: the paths the
setup wrote, the prompt, the counts) -> measurements. Each runs in its own process (so
peak RSS is its own); bench_deploy.py adds the RSS and interleaves the processes.

Every engine returns ``weight_bytes`` (what its weights occupy as it runs),
``bytes_per_token`` (what one decode step reads: every weight but the embedding table, of
which one row, plus the KV cache at the mean position), ``decode_tok_s`` (batch 1, the
new tokens after the first, timed at each token), ``prefill_tok_s`` (one forward of
``job["prefill"]`` tokens), ``tokens`` (the greedy new tokens, compared across engines)
and, where ``job["windows"]`` is given, ``loss`` (mean next-token cross-entropy over them).
The phaseloop engines also split a decode step into its matrix products (replayed alone on
the same tensors) and everything else (Python, attention, norms): ``matmul_ms``,
``step_ms``; ``rss_run`` is the resident set after decoding (``peak_rss``, added by
bench_deploy.py, includes loading). A second family (benchmarks/deploy_runtime.py, ExecuTorch) adds its own
entries to ``ENGINES`` with the same contract.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

MATMUL_OPS = {"mm", "addmm", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "linear",
              "_linear_pointwise"}  # the last: oneDNN, decode_layout's PrepackedLinear


def kv_bytes(cfg: dict, tokens: float, width: int = 4) -> float:
    """Keys and values one decode step reads at ``tokens`` cached positions."""
    return 2 * cfg["n_layers"] * cfg["n_kv_heads"] * cfg["head_dim"] * width * tokens


def _loss_of(logits_fn, windows) -> float:
    total = n = 0
    for w in windows:
        logits = logits_fn(w[:-1])
        total += float(F.cross_entropy(torch.as_tensor(logits).float(), w[1:], reduction="sum"))
        n += len(w) - 1
    return total / n


def _timed_decode(step_times: list[float]) -> float:
    """New tokens per second after the first (the first comes out of the prefill)."""
    return (len(step_times) - 1) / (step_times[-1] - step_times[0])


class _Matmuls(TorchDispatchMode):
    """The matrix products of a forward, with their inputs (references, no copies)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in MATMUL_OPS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _matmul_ms(model, prompt, reps: int = 5) -> float:
    """Milliseconds the matrix products of one cached decode step take alone (the calls
    after the prefill of a 2-token generate, replayed on the same tensors)."""
    marks = []
    with _Matmuls() as cap:
        model.generate(prompt, 2, temperature=0, on_output=lambda _: marks.append(len(cap.calls)))
    calls = cap.calls[marks[0]:marks[1]]
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            for func, args, kwargs in calls:
                func(*args, **kwargs)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def peak_rss() -> int:
    """This process's high-water resident set, bytes (Linux VmHWM, which exec resets:
    ru_maxrss would carry over the parent's peak, the setup's training and exports)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_now() -> int:
    """This process's resident set now, bytes (Linux /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load_phaseloop(job: dict, quantized: str | None, compiled: bool = False):
    """The run's model (packed from ``job["quant"][quantized]``), laid out as `phaseloop
    generate` (``--compile``: without oneDNN's copies) lays it out; its weight bytes and the
    bytes one decode step reads but the KV cache."""
    from phaseloop.engine.checkpoint import load_run
    from phaseloop.inference import decode_layout, prepacked_bytes
    from phaseloop.quant import load_packed, weight_bytes

    if quantized is None:
        model, _ = load_run(job["run"])
    else:
        model, _, _ = load_packed(job["run"], job["quant"][quantized])
    decode_layout(model, prepack=not compiled)  # as `phaseloop generate` and `serve` lay it out
    now, _ = weight_bytes(model)
    emb = model.embed.tok.weight
    # a step reads each Linear's oneDNN copy instead of its dense weight: counted once
    per_token = now - prepacked_bytes(model) - emb.numel() * emb.element_size() + model.cfg.d_model * emb.element_size()
    if model.cfg.tie_embeddings:
        per_token += emb.numel() * emb.element_size()  # the head reads the whole table
    return model, now, per_token


def _prefill(forward, job: dict) -> float:
    long = torch.tensor([job["prefill_ids"]])
    with torch.no_grad():
        forward(long)
        t0 = time.perf_counter()
        forward(long)
        return len(job["prefill_ids"]) / (time.perf_counter() - t0)


def phaseloop_engine(quantized: str | None):
    def run(job: dict) -> dict:
        model, now, per_token = _load_phaseloop(job, quantized)
        prompt = torch.tensor([job["prompt"]])
        marks: list[float] = []
        model.generate(prompt, 4, temperature=0)  # warm
        out = model.generate(prompt, job["new_tokens"], temperature=0,
                             on_output=lambda _: marks.append(time.perf_counter()))
        res = {"weight_bytes": now, "decode_tok_s": _timed_decode(marks), "prefill_tok_s": _prefill(model, job),
               "tokens": out[0, prompt.shape[1]:].tolist(), "step_ms": 1e3 / _timed_decode(marks),
               "bytes_per_token": per_token + kv_bytes(job["cfg"], len(job["prompt"]) + job["new_tokens"] / 2)}
        if job.get("windows") is not None:
            with torch.no_grad():
                res["loss"] = _loss_of(lambda x: model(x[None]).logits[0], job["windows"])
        res["peak_rss"], res["rss_run"] = peak_rss(), rss_now()  # before the diagnostic below
        res["matmul_ms"] = _matmul_ms(model, prompt)
        return res
    return run


def phaseloop_compiled_engine(quantized: str | None):
    """`phaseloop generate --compile` (deploy/compiled.py): the one-token step compiled with
    frozen, prepacked weights on a static cache of prompt + new tokens (attention reads all of
    it at every step: the floor counts it); the prompt's forward and the prefill run eagerly."""
    def run(job: dict) -> dict:
        from phaseloop.decoding import decode
        from phaseloop.deploy.compiled import CompiledDecoder

        model, now, per_token = _load_phaseloop(job, quantized, compiled=True)
        prompt = torch.tensor([job["prompt"]])
        dec = CompiledDecoder(model, prompt.shape[1] + job["new_tokens"])
        marks: list[float] = []
        decode(dec.step, prompt, 4)  # warm
        dec.reset()
        out = decode(dec.step, prompt, job["new_tokens"], on_output=lambda _: marks.append(time.perf_counter()))
        res = {"weight_bytes": now, "decode_tok_s": _timed_decode(marks), "prefill_tok_s": _prefill(model, job),
               "tokens": out[0, prompt.shape[1]:].tolist(), "step_ms": 1e3 / _timed_decode(marks),
               "compile_s": dec.compile_seconds,
               "bytes_per_token": per_token + kv_bytes(job["cfg"], dec.program.max_len)}
        res["peak_rss"], res["rss_run"] = peak_rss(), rss_now()
        return res
    return run


def transformers_engine(job: dict) -> dict:
    from transformers import LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Marks(BaseStreamer):
        def __init__(self):
            self.times, self.first = [], True

        def put(self, value):
            if self.first:  # the prompt
                self.first = False
            else:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    llama = LlamaForCausalLM.from_pretrained(job["llama"], dtype=torch.float32).eval()
    now = sum(p.numel() * p.element_size() for p in llama.parameters())
    emb = llama.model.embed_tokens.weight
    per_token = now - emb.numel() * 4 + emb.shape[1] * 4
    if llama.config.tie_word_embeddings:
        per_token += emb.numel() * 4
    prompt = torch.tensor([job["prompt"]])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    llama.generate(prompt, max_new_tokens=4, **kw)
    marks = Marks()
    out = llama.generate(prompt, max_new_tokens=job["new_tokens"], min_new_tokens=job["new_tokens"],
                         streamer=marks, **kw)
    long = torch.tensor([job["prefill_ids"]])
    with torch.no_grad():
        llama(long)
        t0 = time.perf_counter()
        llama(long)
        prefill = len(job["prefill_ids"]) / (time.perf_counter() - t0)
    res = {"weight_bytes": now, "decode_tok_s": _timed_decode(marks.times), "prefill_tok_s": prefill,
           "tokens": out[0, prompt.shape[1]:].tolist(), "rss_run": rss_now(),
           "bytes_per_token": per_token + kv_bytes(job["cfg"], len(job["prompt"]) + job["new_tokens"] / 2)}
    if job.get("windows") is not None:
        with torch.no_grad():
            res["loss"] = _loss_of(lambda x: llama(x[None]).logits[0], job["windows"])
    return res


def llama_cpp_engine(outtype: str):
    def run(job: dict) -> dict:
        import gguf
        from llama_cpp import Llama

        path = job["gguf"][outtype]
        reader = gguf.GGUFReader(path)
        now = sum(int(t.n_bytes) for t in reader.tensors)
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        per_token = now - int(emb.n_bytes) * (0 if tied else 1) + int(emb.n_bytes) / int(emb.shape[1])
        del reader
        windows = job.get("windows")
        n_ctx = max(256, len(job["prompt"]) + job["new_tokens"], len(job["prefill_ids"]),
                    0 if windows is None else windows.shape[1]) + 8  # llama.cpp's context: at least 256
        llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=job["threads"],
                    n_threads_batch=job["threads"], logits_all=job.get("windows") is not None, verbose=False)
        try:
            def greedy(n):
                times, toks = [], []
                for t in llm.generate(job["prompt"], temp=0.0, top_k=1, reset=True):
                    times.append(time.perf_counter())
                    toks.append(int(t))
                    if len(toks) == n:
                        return times, toks
            greedy(4)
            times, toks = greedy(job["new_tokens"])
            llm.reset()
            llm.eval(job["prefill_ids"])
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(job["prefill_ids"])
            prefill = len(job["prefill_ids"]) / (time.perf_counter() - t0)
            res = {"weight_bytes": now, "decode_tok_s": _timed_decode(times), "prefill_tok_s": prefill,
                   "tokens": toks, "rss_run": rss_now(), "bytes_per_token": per_token + kv_bytes(
                       job["cfg"], len(job["prompt"]) + job["new_tokens"] / 2, 2)}  # llama.cpp's KV: f16
            if job.get("windows") is not None:
                def logits(x):
                    llm.reset()
                    llm.eval(x.tolist())
                    return torch.tensor(llm.scores[:len(x)])
                res["loss"] = _loss_of(logits, job["windows"])
            return res
        finally:
            llm.close()
    return run


def executorch_engine(kind: str):
    """The run's ``export --format executorch`` file (XNNPACK) decoded by ``phaseloop generate
    FILE.pte``'s function (deploy.generate) in ExecuTorch's runtime. Its weights: the file's
    bytes (the program's constants; the embedding stays fp32 in every kind, the head unless
    ``-head``); a step reads all of them but the embedding table, and the whole static cache
    (attention reads every position, masked)."""
    def run(job: dict) -> dict:
        import os

        from phaseloop.deploy.generate import generate, open_pte
        from phaseloop.inference import Options

        exp = open_pte(job["pte"][kind], threads=job["threads"])
        now = os.path.getsize(exp.path)
        vocab, d = exp.record["metadata"]["get_vocab_size"], job["cfg"]["d_model"]
        per_token = now - vocab * d * 4 * (0 if job["cfg"]["tied"] else 1) + d * 4 + exp.record["kv_cache_bytes"]
        prompt = torch.tensor([job["prompt"]])
        marks: list[float] = []
        generate(exp, prompt, Options(max_new_tokens=4))  # warm
        out = generate(exp, prompt, Options(max_new_tokens=job["new_tokens"]),
                       on_output=lambda _: marks.append(time.perf_counter()))
        long = torch.tensor([job["prefill_ids"]])
        exp.model(long, 0)
        t0 = time.perf_counter()
        exp.model(long, 0)
        prefill = len(job["prefill_ids"]) / (time.perf_counter() - t0)
        res = {"weight_bytes": now, "decode_tok_s": _timed_decode(marks), "prefill_tok_s": prefill,
               "tokens": out.tokens[0].tolist(), "step_ms": 1e3 / _timed_decode(marks),
               "bytes_per_token": per_token, "rss_run": rss_now()}
        if job.get("windows") is not None:
            res["loss"] = _loss_of(lambda x: exp.model(x[None], 0)[0], job["windows"])
        return res
    return run


def _no_executorch() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("executorch") else "executorch is not installed (the deploy extra)"


def _no_llama_cpp() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed"


# name -> (function, why it cannot run here or None, needs: what the setup must write)
ENGINES = {
    "phaseloop-fp32": (phaseloop_engine(None), lambda: None, ()),
    "phaseloop-int8": (phaseloop_engine("int8"), lambda: None, ("quant",)),
    "phaseloop-int4": (phaseloop_engine("int4"), lambda: None, ("quant",)),
    # the head packed too (`quantize --head`), as llama.cpp's q8_0 quantises output.weight
    "phaseloop-int8-head": (phaseloop_engine("int8-head"), lambda: None, ("quant",)),
    "phaseloop-int4-head": (phaseloop_engine("int4-head"), lambda: None, ("quant",)),
    # `generate --compile`: the decode step compiled by inductor (deploy/compiled.py)
    "phaseloop-compiled-fp32": (phaseloop_compiled_engine(None), lambda: None, ()),
    "phaseloop-compiled-int4": (phaseloop_compiled_engine("int4"), lambda: None, ("quant",)),
    "phaseloop-compiled-int4-head": (phaseloop_compiled_engine("int4-head"), lambda: None, ("quant",)),
    "transformers": (transformers_engine, lambda: None, ("llama",)),
    "llama.cpp-f32": (llama_cpp_engine("f32"), _no_llama_cpp, ("gguf",)),
    "llama.cpp-q8_0": (llama_cpp_engine("q8_0"), _no_llama_cpp, ("gguf",)),
    # phaseloop's own export of the same run, in ExecuTorch's runtime (`generate FILE.pte`)
    "executorch-fp32": (executorch_engine("fp32"), _no_executorch, ("pte",)),
    "executorch-int8": (executorch_engine("int8"), _no_executorch, ("pte",)),
    "executorch-int4": (executorch_engine("int4"), _no_executorch, ("pte",)),
    "executorch-int8-head": (executorch_engine("int8-head"), _no_executorch, ("pte",)),  # `export --head`
    "executorch-int4-head": (executorch_engine("int4-head"), _no_executorch, ("pte",)),
}
LLAMA_ONLY = {"transformers", "llama.cpp-f32", "llama.cpp-q8_0"}  # a Llama-block rope run only
