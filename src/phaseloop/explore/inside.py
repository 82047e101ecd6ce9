"""Explore's "Inside a trained model" page: a served run and a prompt (typed,
or one of its validation windows, with the document inputs it trained with) through
``phaseloop.analysis.probe``, and a generation from it through
``phaseloop.inference.generate`` (each token's passes under an exit rule, a shared KV cache
or speculation). Prompts are bounded by the model's max_seq_len, one
evaluation runs at a time (``ctx.model_lock``), models and the latest analyses sit in
bounded caches; the endpoints only call the library's functions."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from phaseloop.analysis import probe
from phaseloop.data.corpus import Documents, eval_starts, eval_windows
from phaseloop.early_exit import parse_exit
from phaseloop.engine.checkpoint import checkpoint_dir, load_run, run_corpus, run_tokenizer
from phaseloop.errors import ConfigError
from phaseloop.explore import rundata
from phaseloop.explore.context import BadInput, ServerContext, number
from phaseloop.explore.runs import target
from phaseloop.explore.web import Route, api, page
from phaseloop.inference import Options, generate
from phaseloop.serve.options import as_fields

PAGES = [{"group": "Inside a trained model", "title": "Inside a run", "url": "/inside"}]
ANALYSES = 4  # analyses kept (a page asks several endpoints about the same prompt)
TOP = 10  # next tokens listed
MAX_DEPTH_SWEEP = 16
MAX_NEW = 64  # tokens one generation request may ask for


def validation_windows(run_dir, run_cfg: dict, seq_len: int, n_windows: int = 8) -> list[tuple[torch.Tensor, dict]]:
    """(ids [seq_len + 1], document inputs) each: the ``n_windows`` evenly spaced validation
    windows of the run's own data (``data.eval_windows``, as evaluation reads them), with
    the ``doc_ids_BT`` / ``positions_BT`` rows [seq_len + 1] of a run trained with
    ``--doc-mask`` / ``--doc-positions`` (``data.Documents``, as ``lm.train.eval_set``
    builds them; {} otherwise)."""
    corpus = run_corpus(run_dir, run_cfg)
    train = run_cfg.get("train", {})
    _, val = corpus.split(train.get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(val, seq_len, n_windows)
    docs = Documents.of(corpus, val, bool(train.get("doc_mask")), bool(train.get("doc_positions")))
    inputs = docs.inputs(eval_starts(len(val), seq_len, n_windows), seq_len + 1) if docs is not None else {}
    return [(w, {k: v[i] for k, v in inputs.items()}) for i, w in enumerate(windows)]


class Inside:
    """The state of the inside endpoints: loaded models (in ``ctx``'s bounded cache) and
    the latest analyses (LRU)."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.analyses: OrderedDict = OrderedDict()
        self.windows: OrderedDict = OrderedDict()  # loaded key -> the run's validation windows

    def loaded(self, run: Path):
        """(model, run_cfg, tokenizer, key): key names the checkpoint's files as loaded."""
        ckpt = checkpoint_dir(run)
        if ckpt is None:
            raise BadInput(f"{run.name} has no checkpoint yet; wait for its first --ckpt-every step")
        stamp = max((p.stat().st_mtime_ns for p in ckpt.iterdir()), default=0)

        def load():
            model, run_cfg = load_run(run)
            return model, run_cfg, run_tokenizer(run, run_cfg)

        key = (str(run), str(ckpt), stamp)
        return (*self.ctx.model(key, load), key)

    def ids(self, run: Path, params: dict) -> tuple[torch.Tensor, dict]:
        """(ids, document inputs): a validation window as the run trained (``window``), or
        the typed prompt (one document: no document inputs)."""
        model, run_cfg, tok, key = self.loaded(run)
        L = model.cfg.max_seq_len
        if params.get("window") not in (None, ""):
            k = number(params, "window", int, lo=0, hi=7)
            # the corpus is read once per loaded run, L tokens a window
            windows = self.ctx.cached(self.windows, key, lambda: validation_windows(run, run_cfg, L - 1), ANALYSES)
            if k >= len(windows):
                raise BadInput(f"window must be between 0 and {len(windows) - 1}, got {k}")
            return windows[k]
        return probe.encode_prompt(tok, params.get("prompt"), L), {}

    def analysis(self, params: dict):
        run = target(self.ctx, params, "run")
        model, run_cfg, tok, loaded = self.loaded(run)
        ids, docs = self.ids(run, params)
        key = (loaded, tuple(ids.tolist()), tuple((k, tuple(v.tolist())) for k, v in sorted(docs.items())))
        with self.ctx.cache_lock:
            a = self.analyses.get(key)
            if a is not None:
                self.analyses.move_to_end(key)
        if a is None:
            with self.ctx.model_lock:
                a = probe.analyze(model, ids, docs=docs)
            with self.ctx.cache_lock:
                self.analyses[key] = a
                while len(self.analyses) > ANALYSES:
                    self.analyses.popitem(last=False)
        return run, model, tok, ids, docs, a


def _tokens(tok, ids) -> list[str]:
    return [tok.decode([i]) for i in ids]


def routes(ctx: ServerContext) -> list:
    inside = Inside(ctx)

    def runs(ctx: ServerContext, params: dict) -> dict:
        out = []
        for root, base in ctx.roots.items():
            for k, rel in rundata.find(base):
                if k == "run" and checkpoint_dir(base / rel) is not None:
                    out.append({"root": root, "path": rel, "name": f"{root}/{rel}" if rel else root})
        return {"runs": out}

    def analyze(ctx: ServerContext, params: dict) -> dict:
        run, model, tok, ids, docs, a = inside.analysis(params)
        cfg = model.cfg
        return {**a.summary(), "tokens": _tokens(tok, ids), "arch": cfg.arch, "max_seq_len": cfg.max_seq_len,
                "vocab_size": cfg.vocab_size, "dynamic_depth": bool(model.trunk.dynamic_depth),
                "n_phases": getattr(cfg, "n_phases", 1),  # the document inputs the window was read with
                "doc_ids": docs.get("doc_ids_BT"), "positions": docs.get("positions_BT")}

    def attention(ctx: ServerContext, params: dict) -> dict:
        run, model, tok, ids, docs, a = inside.analysis(params)
        if not a.attention:
            raise BadInput("this model has no self-attention to draw")
        site = number(params, "site", int, default=0, lo=0, hi=len(a.attention) - 1)
        name, p_HTT = a.attention[site]
        head = number(params, "head", int, default=0, lo=0, hi=p_HTT.shape[0] - 1)
        return {"site": name, "head": head, "weights": p_HTT[head], "tokens": _tokens(tok, ids)}

    def next_token(ctx: ServerContext, params: dict) -> dict:
        run, model, tok, ids, docs, a = inside.analysis(params)
        pos = number(params, "pos", int, default=len(ids) - 1, lo=0, hi=len(ids) - 1)
        temperature = number(params, "temperature", float, default=1.0, lo=0.01, hi=100.0)
        top_k = number(params, "top_k", int, default=model.cfg.vocab_size, lo=1, hi=model.cfg.vocab_size)
        rows = probe.next_token(a.logits[pos], temperature, top_k, TOP)
        for r in rows:
            r["text"] = tok.decode([r["id"]])
        actual = ids[pos + 1].item() if pos + 1 < len(ids) else None
        return {"pos": pos, "context_token": tok.decode([ids[pos].item()]), "temperature": temperature,
                "top_k": top_k, "tokens": rows, "actual": None if actual is None else tok.decode([actual])}

    def depth(ctx: ServerContext, params: dict) -> dict:
        run, model, tok, ids, docs, a = inside.analysis(params)
        if not model.trunk.dynamic_depth:
            raise BadInput(f"a {model.cfg.arch} model has a fixed depth: no loss against depth to draw")
        hi = number(params, "max_depth", int, default=8, lo=1, hi=MAX_DEPTH_SWEEP)
        with ctx.model_lock:
            return {"rows": probe.loss_vs_depth(model, ids, list(range(1, hi + 1)), docs)}

    def generation(ctx: ServerContext, params: dict) -> dict:
        """``inference.generate`` from the prompt: each new token with the passes behind it."""
        run = target(ctx, params, "run")
        model, _, tok, _ = inside.loaded(run)
        ids, docs = inside.ids(run, params)
        if docs:
            raise BadInput("a run trained with document inputs generates from a typed prompt, not a validation window")
        L = model.cfg.max_seq_len
        if len(ids) >= L:
            raise BadInput(f"the prompt fills the model's max_seq_len {L}: shorten it to generate")
        n = min(number(params, "max_new_tokens", int, default=24, lo=1, hi=MAX_NEW), L - len(ids))  # the room left
        rule = (params.get("exit") or "").strip()
        rules = parse_exit(rule) if rule else [None]
        if len(rules) > 1:
            raise BadInput(f"exit {rule!r}: give one value")
        opts = Options(max_new_tokens=n, exit=rules[0], kv_fill=params.get("kv_fill") or "recompute",
                       temperature=number(params, "temperature", float, default=0.0, lo=0.0, hi=100.0),
                       seed=number(params, "seed", int, default=0, lo=0, hi=2**31),
                       kv_share=number(params, "kv_share", int, default=0, lo=0, hi=4096) or None,
                       speculative=number(params, "speculative", int, default=0, lo=0, hi=4096) or None)
        with ctx.model_lock:
            try:
                g = generate(model, ids[None], opts)
            except ConfigError as e:  # the CLI's refusal, worded for this query's fields
                raise BadInput(as_fields(e)) from None
            depth = model.trunk.passes  # under the lock: a speculative request sets the draft's depth
        new = g.tokens[0].tolist()
        return {"prompt": _tokens(tok, ids.tolist()), "tokens": _tokens(tok, new), "ids": new, "passes": g.passes,
                "depth": depth, "mean_passes": g.mean_passes, "tokens_per_s": g.tokens_per_s,
                "kv_cache_bytes": g.kv_cache_bytes, "acceptance": g.acceptance}

    return [
        Route("/inside", page("inside/index.html", "Inside a trained model")),
        Route("/api/inside/generate", api(generation)),
        Route("/api/inside/runs", api(runs)),
        Route("/api/inside/analyze", api(analyze)),
        Route("/api/inside/attention", api(attention)),
        Route("/api/inside/next", api(next_token)),
        Route("/api/inside/depth", api(depth)),
    ]
