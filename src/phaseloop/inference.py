"""Generation as a library function (``generate``): the one entry point the CLI, explore
and the tests decode through, with the inference-time options of a weight-tied trunk —
an exit rule and the fill of the passes it skips (``early_exit``), a KV cache shared
across passes (``--kv-share K``, Huginn §6.2) and self-speculative decoding
(``speculative``) — and what it measured: tokens/s, passes per token, cache bytes,
acceptance. ``TokenByToken`` evaluates a model as decoding feeds it (every token through
the cache), which a shared cache changes and a full pass does not see.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop.decoding import check_request, decode, speculative_decode
from phaseloop.early_exit import ExitRule, refuse_stack, set_exit, set_kv_share
from phaseloop.errors import ConfigError
from phaseloop.kvcache import KVCache


@dataclass
class Options:
    """How to decode. ``exit`` / ``kv_fill``: early exit per position and the keys/values
    of the passes it skips; ``kv_share``: KV slots per looped layer; ``speculative``: draft
    with that many passes, ``draft_tokens`` per round, verified at the trunk's depth."""

    max_new_tokens: int = 200
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    eos_id: int | None = None
    use_cache: bool = True
    exit: ExitRule | None = None
    kv_fill: str = "recompute"
    kv_share: int | None = None
    speculative: int | None = None
    draft_tokens: int = 4

    def cache_positions(self, prompt_len: int) -> int:
        """Positions a cached decode writes: the prompt and every new token fed back (the
        last one never is: ``decoding.decode``)."""
        return prompt_len + max(self.max_new_tokens - 1, 0)

    def dynamic_flags(self) -> list[str]:
        """The flags in use that a program of fixed depth on its own static cache (an
        ExecuTorch export, a compiled step) cannot take."""
        return [flag for flag, on in (("--exit", self.exit is not None), ("--kv-share", self.kv_share is not None),
                                      ("--kv-fill", self.kv_fill != "recompute"),
                                      ("--speculative", self.speculative is not None),
                                      ("--no-cache", not self.use_cache)) if on]


@dataclass
class Generation:
    """``ids`` prompt + new [B, T + n]; ``tokens`` the new ones [B, n]; ``passes`` [n] the
    loop passes behind each new token (mean over rows; speculative: the passes every
    drafted and verified position ran, per token kept); ``acceptance`` drafts kept / drafted."""

    ids: torch.Tensor
    tokens: torch.Tensor
    seconds: float
    passes: list = field(default_factory=list)
    kv_cache_bytes: int = 0
    acceptance: float | None = None
    rounds: int | None = None
    compile_seconds: float | None = None  # a compiled step's compile (deploy/compiled.py), not in seconds
    compile_autotuned: bool | None = None  # False: its GEMM templates failed, compiled without (compiled.py)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / max(self.seconds, 1e-9)

    @property
    def mean_passes(self) -> float | None:
        return sum(self.passes) / len(self.passes) if self.passes and None not in self.passes else None


@contextmanager
def configured(model, options: Options):
    """``model`` with ``options``' exit rule and KV sharing, restored afterwards."""
    trunk = model.trunk
    saved = (trunk.exits, getattr(trunk, "kv_share", None))
    try:
        if options.exit is not None or options.kv_fill != "recompute":
            set_exit(model, options.exit, options.kv_fill)
        if options.kv_share is not None:
            set_kv_share(model, options.kv_share)
        yield model
    finally:
        trunk.exits = saved[0]
        if saved[1] is not None or options.kv_share is not None:
            trunk.kv_share = saved[1]


def check(model, options: Options, prompt_BT: torch.Tensor) -> None:
    """Refuse, in one line, what ``model`` cannot decode with ``options``."""
    if prompt_BT is not None:
        check_request(prompt_BT, options.max_new_tokens, options.temperature, options.top_k, model.cfg.vocab_size)
    if options.kv_share is not None and not options.use_cache:
        raise ConfigError("--kv-share shares the KV cache across passes: drop --no-cache (without a cache "
                          "every pass reads its own keys, and nothing is shared)")
    if options.kv_share is not None and act_rows(model, prompt_BT) > 1:
        raise ConfigError(f"UT+ACT with --kv-share decodes one prompt at a time, not {prompt_BT.shape[0]}: "
                          "the steps each row runs decide which keys a shared slot keeps")
    if options.speculative is None:
        return
    if options.kv_share is not None:
        raise ConfigError("--speculative verifies its drafts in one forward, which reads a shared KV cache "
                          "unlike token-by-token decoding does: drop --kv-share")
    refuse_stack(model, "draft itself with fewer passes", "--speculative")
    full = model.trunk.passes
    if full < 2:
        raise ConfigError(f"--speculative drafts with fewer passes than the model runs, and it runs {full}: "
                          "decode at --depth 2 or more, or drop --speculative")
    if not isinstance(options.speculative, int) or not 1 <= options.speculative < full:
        raise ConfigError(f"--speculative {options.speculative}: the draft runs 1 .. {full - 1} passes "
                          f"(the model runs {full})")
    if options.exit is not None:
        raise ConfigError("--speculative verifies at the full depth: drop --exit (the draft is --speculative D passes)")
    if not options.use_cache:
        raise ConfigError("--speculative rolls the KV cache back after each round: drop --no-cache")
    if not isinstance(options.draft_tokens, int) or options.draft_tokens < 1:
        raise ConfigError(f"--draft-tokens {options.draft_tokens!r}: must be a positive integer")


def act_rows(model, x_BT: torch.Tensor | None) -> int:
    """Rows of ``x_BT`` a UT+ACT model would run in one batch (0: not ACT, or no input).
    Under ``--kv-share`` they cannot share one: a row's later steps overwrite the shared
    slots only if some other row still runs, so each row is decoded on its own."""
    return 0 if x_BT is None or getattr(model.trunk, "halting", None) is None else x_BT.shape[0]


def recording_passes(default, on_output=None) -> tuple[list, Callable]:
    """(passes, an ``on_output`` for ``decoding.decode``) for a step whose outputs may carry
    ``passes`` (the steps behind the next token: UT + ACT in a program): each output's, or
    ``default`` (the fixed depth), then ``on_output``."""
    passes = []

    def seen(out):
        steps = getattr(out, "passes", None)
        passes.append(default if steps is None else steps)
        if on_output is not None:
            on_output(out)
    return passes, seen


def _passes(out, trunk) -> torch.Tensor | float | None:
    """Passes behind the last position of a model output (the next token's): per row, a
    tensor read by ``_mean_passes`` once decoding is over (no host read a token); None for
    a stack, which has no passes."""
    s = out.stats.get("exit_passes")  # [B, T], made by this forward and not changed after it
    if s is not None:
        return s
    return None if trunk.passes is None else float(trunk.passes)


def _mean_passes(passes: list) -> list:
    """``_passes``' records as floats: each tensor's last position averaged over the rows,
    read in one go."""
    at = [i for i, p in enumerate(passes) if isinstance(p, torch.Tensor)]
    if at:
        means = torch.stack([passes[i][:, -1] for i in at]).float().mean(1).tolist()
        passes = list(passes)
        for i, m in zip(at, means):
            passes[i] = m
    return passes


def clock(device: torch.device) -> float:
    """``time.perf_counter`` once ``device`` has finished the work queued on it (a CUDA
    decode whose tokens were never read would otherwise be timed before it ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate(model, prompt_BT: torch.Tensor, options: Options) -> Generation:
    """Decode ``prompt_BT`` with ``options`` (``Generation``: the tokens and the figures)."""
    check(model, options, prompt_BT)
    gen = torch.Generator(device=prompt_BT.device).manual_seed(options.seed)
    was_training = model.training
    model.eval()
    try:
        with configured(model, options):
            t0 = clock(prompt_BT.device)
            if options.speculative is not None:
                ids, info = speculative_decode(model, prompt_BT, options.max_new_tokens, options.speculative,
                                               options.draft_tokens, options.temperature, options.top_k,
                                               gen, options.eos_id)
                seconds = clock(prompt_BT.device) - t0
                n = ids.shape[1] - prompt_BT.shape[1]
                return Generation(ids, ids[:, prompt_BT.shape[1]:], seconds, [info["passes"] / max(n, 1)] * n,
                                  info["cache"].nbytes, info["acceptance"], info["rounds"])
            passes, caches = [], []

            def step(x_BT, cache):
                if cache is not None and not caches:
                    caches.append(cache)
                return model(x_BT, cache=cache)

            ids = decode(step, prompt_BT, options.max_new_tokens, temperature=options.temperature,
                         top_k=options.top_k, generator=gen, eos_id=options.eos_id, use_cache=options.use_cache,
                         on_output=lambda out: passes.append(_passes(out, model.trunk)))
            passes = _mean_passes(passes)
            seconds = clock(prompt_BT.device) - t0
    finally:
        model.train(was_training)
    n = ids.shape[1] - prompt_BT.shape[1]
    return Generation(ids, ids[:, prompt_BT.shape[1]:], seconds, passes[:n], caches[0].nbytes if caches else 0)


def cache_bytes_after(model, prompt_BT: torch.Tensor, options: Options) -> int:
    """Bytes a cache holds after a prefill of ``prompt_BT`` (grown, not preallocated)."""
    cache = KVCache()
    with torch.no_grad(), configured(model, options):
        model(prompt_BT, cache=cache)
    return cache.nbytes


class TokenByToken(nn.Module):
    """``model`` evaluated as decoding feeds it: every position through the KV cache, one
    token at a time (``forward(x)`` returns the logits of the whole window). Equal to the
    full pass with one slot per pass; with ``--kv-share`` a token reads the earlier ones'
    keys of the latest pass in its slot."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx_BT: torch.Tensor, **kw):
        if kw:
            raise ConfigError("token-by-token evaluation feeds one sequence per row; documents "
                              "(--doc-mask, --doc-positions) do not apply")
        if getattr(self.model.trunk, "kv_share", None) is not None and act_rows(self.model, idx_BT) > 1:
            # UT+ACT with shared slots: each row alone (``act_rows``), as decoding runs it
            rows = [self(idx_BT[b:b + 1]) for b in range(idx_BT.shape[0])]
            return type(rows[0])(logits=torch.cat([r.logits for r in rows], 0))
        cache = KVCache(capacity=idx_BT.shape[1])
        outs = [self.model(idx_BT[:, t:t + 1], cache=cache) for t in range(idx_BT.shape[1])]
        self.last_cache = cache
        return type(outs[0])(logits=torch.cat([o.logits for o in outs], 1))



class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` whose fp32 CPU products run on oneDNN's inner product with the
    weight prepacked in its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
    what inductor's frozen CPU graphs call), and on ``F.linear`` under autograd, autocast
    and compilation, for other dtypes and devices, a tensor-subclass or inference-mode
    weight, and one row on one thread (there MKL streams a column-major weight faster:
    ``decode_layout``). The parameters stay as they are (``state_dict``, ties, training).
    The packed copy is held beside them with the weight's storage (so its address is not
    reused while the copy lives), remade when the weight's version, storage or strides
    change (an optimizer step, ``load_state_dict``, assigning ``.data``), and neither
    copied nor pickled with the module; a write the version counter does not see (through
    ``w.data``, numpy or DLPack) needs ``decode_layout`` again, which packs anew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (torch.compiler.is_compiling() or x.dtype != torch.float32 or type(w.data) is not torch.Tensor
                or w.dtype != torch.float32 or x.device.type != "cpu" or w.device.type != "cpu"
                or w.is_inference() or not torch._C._get_mkldnn_enabled() or not onednn_linear()
                or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                 or (b is not None and b.requires_grad)))
                or (x.numel() == x.shape[-1] and torch.get_num_threads() == 1)):  # one row, one thread
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed(), b, "none", [None], "")

    def packed(self) -> torch.Tensor:
        """The weight in oneDNN's layout, packed anew if the weight changed since."""
        w, have = self.weight, self.__dict__.get("_onednn")
        key = (w._version, w.data_ptr(), w.stride())
        if have is None or have[0] != key:
            self.unpack()
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
                have = self.__dict__["_onednn"] = (key, packed, w.untyped_storage())
        return have[1]

    def unpack(self) -> None:
        """Drop the packed copy (the next product packs the weight anew)."""
        self.__dict__.pop("_onednn", None)

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed copy: its logical size, 4 per weight (0 before the first
        pack); a blocked layout may pad odd shapes beyond it."""
        have = self.__dict__.get("_onednn")
        return 0 if have is None else have[1].numel() * have[1].element_size()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_onednn", None)  # an opaque oneDNN tensor: packed again at the next product
        return state


def prepacked_bytes(model: nn.Module) -> int:
    """Bytes of the oneDNN copies ``decode_layout`` packed beside ``model``'s weights."""
    return sum(m.packed_nbytes for m in model.modules() if isinstance(m, PrepackedLinear))


@functools.cache
def onednn_linear() -> bool:
    """Whether this torch runs ``PrepackedLinear``'s products (oneDNN built in and working)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        w, x = torch.arange(32.0).view(8, 4) / 7, torch.arange(12.0).view(3, 4) / 5  # no RNG draw
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None,
                                               "none", [None], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-5))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@torch.no_grad()
def decode_layout(model: nn.Module, prepack: bool | None = None) -> int:
    """Lay out each fp32 ``nn.Linear`` of a CPU model for inference; returns how many are
    laid out afterwards (prepacked, or column-major only).

    A weight at least as wide out as in is stored column-major: ``F.linear(x, W)`` hands
    BLAS ``x @ W.t()``, N dot products of K-long rows with ``W`` [N, K] row-major, K sweeps
    over N-long rows with ``W`` a view of a contiguous [K, N] tensor, which one-row
    products stream faster when N >= K (20-25 against 12-14 GB/s at rope-123m's shapes)
    and slower when narrower.

    With ``prepack`` (None: where torch has oneDNN, ``onednn_linear``) each plain
    ``nn.Linear`` also becomes a ``PrepackedLinear`` (packed anew if it was one; with
    ``prepack=False`` it is a plain ``nn.Linear`` again): its products run on oneDNN with
    the weight prepacked once, at the cost of a copy of each weight beside it
    (``quant.weight_bytes`` counts it). Measured here (docs/deploy.md,
    ``benchmarks/deploy_kernels.py``): oneDNN is 1.3-6x faster than torch's MKL ``sgemm``
    behind ``F.linear`` at 3-96 rows of a weight in cache on two threads, 1.2-1.4x at 128
    rows read from memory on one, and 0.5-4x at one row on two threads; one row on one
    thread MKL's column-major product is faster (a rope-123m decode step 0.76x on oneDNN),
    so that case stays on it.

    Either way the values are the same and the products differ in fp32 summation order
    only; shapes, names and ties stay (a tied embedding gathers the dense weight), so
    ``state_dict`` reads them, but ``safetensors`` refuses a column-major tensor: a model
    laid out here is for inference."""
    done, seen = 0, set()
    prepack = onednn_linear() if prepack is None else prepack and onednn_linear()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (not isinstance(m, nn.Linear) or type(w.data) is not torch.Tensor or w.device.type != "cpu"
                or w.dtype != torch.float32 or id(m) in seen):  # a tensor subclass (torchao) is its own layout
            continue
        seen.add(id(m))
        wide = w.shape[0] >= w.shape[1]
        if wide and not w.t().is_contiguous():  # a weight shared by two modules: moved once
            w.data = w.data.t().contiguous().t()
        if isinstance(m, PrepackedLinear):
            m.unpack()  # packed anew below, or back to a plain Linear
            if not prepack:
                m.__class__ = nn.Linear
        if prepack and type(m) in (nn.Linear, PrepackedLinear) and not w.is_inference():
            m.__class__ = PrepackedLinear
            m.packed()
        done += wide or isinstance(m, PrepackedLinear)
    return done
