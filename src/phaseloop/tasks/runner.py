"""Train and evaluate a model on task examples (Dehghani et al. 2019, "Universal
Transformers": §3.1 bAbI, §3.4 algorithmic tasks; a user's JSONL file works the same way).

Two model families, one interface (``TaskModel``: ``loss(pairs)``, ``greedy(srcs)``):

* decoder-only (every registered ``arch``): the sequence is ``input + SEP + target + EOS``;
  the loss is on the target tokens and EOS only (targets are -100 on the prompt and on
  SEP, which ``DecoderLM.forward`` ignores). Decoding is greedy with the KV cache,
  batched over prompts of equal length (no padding inside a prompt, so nothing but the
  prompt is attended to).
* encoder-decoder (``seq2seq.py``: ``--arch transformer-seq2seq | universal-seq2seq``):
  source -> BOS + target + EOS with the source padding mask; see ``Seq2SeqTaskModel``.

Random position offsets (the paper trains the UT with them, tensor2tensor's
``position_start_index="random"``): one start position per batch, uniform in
``[0, max_offset]``, i.e. the whole sequence is shifted to positions
``offset .. offset + T - 1``. For decoder-only models this is an empty ``KVCache`` whose
``pos`` is the offset (``DecoderLM`` starts its positions at ``cache.pos``), so RoPE, the
UT coordinate signal and the 3PT horn all see the shifted positions and no skeleton
change is needed (encoder-decoders: see ``Seq2SeqTaskModel``). Caveats: RoPE is
relative, so the shift changes nothing for a RoPE-only model (only absolute signals,
e.g. the UT's sinusoid, see it); and a cached forward runs an ACT trunk for all its max
steps (same outputs, more compute).

Ponder time (ACT models): ``ModelOutput.stats["ponder_time"]`` [B, T] = n_updates +
remainders per position. Reported per test length as mean +- std over every position
the model processed (prompt, SEP and fed-back answer tokens), and for bAbI per example
(mean over its positions, and at the answer position, i.e. SEP) grouped by the number
of supporting facts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..validation import check_ints
from .algorithmic import CharVocab, Example, TaskSpec, parse_lengths, position_offsets
from .babi import BabiExample, failed_tasks, format_example, load_babi, ponder_by_supporting, task_error
from .metrics import mean_std, per_length_metrics

Pair = tuple[list[int], list[int]]  # (source ids, target ids ending in EOS)


# ----------------------------------------------------------------------------- config
@dataclass
class TaskRunConfig:
    """Optimisation and evaluation settings of one task run. Field names match
    ``train.TrainConfig`` where they overlap, so ``lr_at``/``make_optimizer`` apply."""

    steps: int = 400
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    seed: int = 0
    max_offset: int = 0  # random start-position shift per training batch (0 = off)
    eval_batch_size: int = 100
    log_every: int = 50
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_ints(self, ("steps", "batch_size", "eval_batch_size", "log_every"), "task config")
        check_ints(self, ("warmup_steps", "max_offset", "seed"), "task config", minimum=0)
        if not self.lr > 0:
            raise ConfigError(f"invalid task config: lr={self.lr!r}: must be > 0")

    def replace(self, **kw) -> "TaskRunConfig":
        return TaskRunConfig(**{**asdict(self), **kw})


# ----------------------------------------------------------------------------- vocab
class WordVocab:
    """Word-level vocabulary for bAbI (and any whitespace-tokenised text): words and
    punctuation marks are tokens; the special ids match ``CharVocab`` (PAD 0, EOS 1,
    SEP 2). ``decode`` joins tokens with spaces."""

    PAD, EOS, SEP = CharVocab.PAD, CharVocab.EOS, CharVocab.SEP
    SPECIALS = CharVocab.SPECIALS
    _TOKEN = re.compile(r"\w+|[^\w\s]")

    def __init__(self, words: Sequence[str]):
        self.words = list(dict.fromkeys(words))
        self._to_id = {w: i + len(self.SPECIALS) for i, w in enumerate(self.words)}

    @classmethod
    def tokenize(cls, text: str) -> list[str]:
        return cls._TOKEN.findall(text.lower())

    @classmethod
    def for_texts(cls, texts) -> "WordVocab":
        return cls(sorted({w for t in texts for w in cls.tokenize(t)}))

    def __len__(self) -> int:
        return len(self.SPECIALS) + len(self.words)

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[w] for w in self.tokenize(text)]
        except KeyError as e:
            raise ConfigError(f"word {e.args[0]!r} is not in the vocabulary; build it from all texts") from None
        return ids + [self.EOS] if add_eos else ids

    def decode(self, ids) -> str:
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == self.EOS:
                break
            if i >= len(self.SPECIALS):
                out.append(self.words[i - len(self.SPECIALS)])
        return " ".join(out)


def encode_pairs(examples: Sequence[Example], vocab) -> list[Pair]:
    return [(vocab.encode(ex.input), vocab.encode(ex.target, add_eos=True)) for ex in examples]


# ----------------------------------------------------------------------------- models
def decoder_batch(pairs: Sequence[Pair], pad: int = CharVocab.PAD, sep: int = CharVocab.SEP):
    """``(idx_BT, targets_BT)`` for a decoder-only LM: each row is ``src + SEP + tgt``
    shifted by one; targets are -100 on the prompt and right padding, so the loss counts
    exactly the target tokens (incl. EOS), predicted from SEP onwards."""
    seqs = [s + [sep] + t for s, t in pairs]
    T = max(len(q) for q in seqs) - 1
    idx_BT = torch.full((len(seqs), T), pad, dtype=torch.long)
    tgt_BT = torch.full((len(seqs), T), -100, dtype=torch.long)
    for b, (q, (s, _)) in enumerate(zip(seqs, pairs)):
        n = len(q) - 1
        idx_BT[b, :n] = torch.tensor(q[:-1])
        tgt_BT[b, len(s):n] = torch.tensor(q[len(s) + 1:])
    return idx_BT, tgt_BT


class DecoderTaskModel:
    """A ``DecoderLM`` (any arch) as a prompt -> answer model."""

    kind = "decoder"

    def __init__(self, model, sep: int = CharVocab.SEP, eos: int = CharVocab.EOS):
        self.model, self.sep, self.eos = model, sep, eos

    def loss(self, pairs: Sequence[Pair], offset: int = 0, device="cpu"):
        from ..layers import KVCache

        idx_BT, tgt_BT = decoder_batch(pairs, sep=self.sep)
        # An empty cache at pos=offset starts the sequence at that absolute position.
        cache = KVCache(pos=offset) if offset else None
        return self.model(idx_BT.to(device), tgt_BT.to(device), cache=cache)

    @torch.no_grad()
    def greedy(self, srcs: Sequence[list[int]], max_new: int, device="cpu"):
        """Greedy answers for prompts of equal length, with the KV cache. Returns the
        generated ids [B, <= max_new] and the ponder time [B, positions processed] (or
        None); position j of the ponder row is prompt token j, then SEP, then the fed
        back answer tokens."""
        from ..layers import KVCache

        B = len(srcs)
        cache = KVCache()
        x_BT = torch.tensor([s + [self.sep] for s in srcs], device=device)
        out = self.model(x_BT, cache=cache)
        ponder = [out.stats["ponder_time"]] if "ponder_time" in out.stats else None
        gen, done = [], torch.zeros(B, dtype=torch.bool, device=device)
        for k in range(max_new):
            nxt_B = out.logits[:, -1].argmax(-1)
            gen.append(nxt_B)
            done |= nxt_B == self.eos
            if done.all() or k == max_new - 1:
                break
            out = self.model(nxt_B[:, None], cache=cache)
            if ponder is not None:
                ponder.append(out.stats["ponder_time"])
        return torch.stack(gen, 1), (torch.cat(ponder, 1) if ponder is not None else None)

    def answer_position(self, src_len: int) -> int:
        return src_len  # SEP: the position that predicts the first answer token


class Seq2SeqTaskModel:
    """An encoder-decoder of ``seq2seq.py`` (vanilla Transformer, UT, UT+ACT): source ->
    BOS + target + EOS, teacher-forced loss on the target (``seq2seq.collate``); BOS is
    the vocabulary's SEP id. Random position offsets: ``offset`` PAD tokens before the
    source (PAD keys are masked out of attention, so the real tokens just sit at
    positions offset.. ; ACT also counts the pads in its ponder loss) and an empty
    ``KVCache`` at pos=offset for the decoder. Ponder rows are the encoder positions,
    then the decoder positions (BOS and the fed-back answer tokens)."""

    kind = "seq2seq"

    def __init__(self, model, bos: int = CharVocab.SEP, eos: int = CharVocab.EOS,
                 pad: int = CharVocab.PAD):
        self.model, self.bos, self.eos, self.pad = model, bos, eos, pad

    def loss(self, pairs: Sequence[Pair], offset: int = 0, device="cpu"):
        from ..layers import KVCache
        from ..seq2seq import collate

        src_BS, tgt_in_BT, tgt_BT = collate([(s, t[:-1]) for s, t in pairs], self.pad, self.bos,
                                            self.eos, device)
        if offset:
            src_BS = F.pad(src_BS, (offset, 0), value=self.pad)
        return self.model(src_BS, tgt_in_BT, tgt_BT, cache=KVCache(pos=offset) if offset else None)

    @torch.no_grad()
    def greedy(self, srcs: Sequence[list[int]], max_new: int, device="cpu"):
        from ..layers import KVCache

        src_BS = torch.tensor(srcs, device=device)
        memory = self.model.encode(src_BS)
        enc_stats = memory[2].stats
        ponder = [enc_stats["ponder_time"]] if "ponder_time" in enc_stats else None
        cache, B = KVCache(), len(srcs)
        inp_B1 = torch.full((B, 1), self.bos, dtype=torch.long, device=device)
        gen, done = [], torch.zeros(B, dtype=torch.bool, device=device)
        for k in range(max_new):
            out = self.model(src_BS, inp_B1, cache=cache, memory=memory)
            if ponder is not None and "decoder_ponder_time" in out.stats:
                ponder.append(out.stats["decoder_ponder_time"])
            nxt_B = out.logits[:, -1].argmax(-1)
            gen.append(nxt_B)
            done |= nxt_B == self.eos
            if done.all():
                break
            inp_B1 = nxt_B[:, None]
        return torch.stack(gen, 1), (torch.cat(ponder, 1) if ponder is not None else None)

    def answer_position(self, src_len: int) -> int:
        return src_len  # the decoder's BOS position predicts the first answer token


SEQ2SEQ_ARCHS = ("transformer-seq2seq", "universal-seq2seq")


def build_task_model(model_cfg: ModelConfig, seed: int = 0, arch: str | None = None):
    """A task model with weights initialised from ``seed``. ``arch`` in
    ``SEQ2SEQ_ARCHS`` picks an encoder-decoder (``transformer-seq2seq`` needs a
    non-universal config, ``universal-seq2seq`` arch='universal'; ``act=True`` gives
    UT+ACT on both sides); otherwise a ``DecoderLM`` of ``model_cfg.arch``."""
    torch.manual_seed(seed)
    if arch in SEQ2SEQ_ARCHS:
        from ..seq2seq import TransformerSeq2Seq, UniversalSeq2Seq

        if (arch == "universal-seq2seq") != (model_cfg.arch == "universal"):
            raise ConfigError(f"--arch {arch} needs a {'universal' if arch.startswith('universal') else 'non-universal'}"
                              f" model config, got arch={model_cfg.arch!r}; change --preset")
        cls = UniversalSeq2Seq if arch == "universal-seq2seq" else TransformerSeq2Seq
        return Seq2SeqTaskModel(cls(model_cfg, pad_id=CharVocab.PAD))
    from ..model import build_model

    return DecoderTaskModel(build_model(model_cfg))


# ----------------------------------------------------------------------------- train
def train_pairs(tm, pairs: Sequence[Pair], rc: TaskRunConfig,
                log: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``tm`` on ``pairs`` for ``rc.steps`` AdamW steps (warmup + cosine, as
    ``phaseloop train``); batches are drawn epoch-wise without replacement. Returns the
    logged records (step, loss = answer cross-entropy, aux losses, lr)."""
    from ..train import lr_at, make_optimizer

    if not pairs:
        raise ConfigError("no training examples; give at least one")
    model = tm.model
    model.to(rc.device).train()
    opt = make_optimizer(model, rc)
    g = torch.Generator().manual_seed(rc.seed)
    order, cursor, records = torch.randperm(len(pairs), generator=g), 0, []
    for step in range(rc.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, rc)
        if cursor + rc.batch_size > len(order):
            order, cursor = torch.randperm(len(pairs), generator=g), 0
        batch = [pairs[i] for i in order[cursor: cursor + rc.batch_size].tolist()]
        cursor += rc.batch_size
        offset = int(position_offsets(1, rc.max_offset, g)[0]) if rc.max_offset else 0
        out = tm.loss(batch, offset, rc.device)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), rc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % rc.log_every == 0 or step + 1 == rc.steps:
            rec = {"step": step + 1, "loss": out.ce_loss.item(), "lr": lr_at(step, rc),
                   **{k: v.item() for k, v in out.aux_losses.items()}}
            records.append(rec)
            if log is not None:
                log(rec)
    return records


# ----------------------------------------------------------------------------- evaluate
@dataclass
class Decoded:
    """Greedy predictions (token ids, EOS excluded) and per-example ponder rows."""

    ids: list[list[int]]
    ponder: list[torch.Tensor | None]  # per position processed, or None (no ACT)
    answer_ponder: list[float | None] = field(default_factory=list)


def decode_pairs(tm, pairs: Sequence[Pair], batch_size: int = 100, device="cpu",
                 slack: int = 1) -> Decoded:
    """Greedy-decode every source; up to len(target) + ``slack`` tokens (the target
    length includes EOS, so an answer may run ``slack`` tokens long and be counted
    wrong). Prompts are batched by equal length."""
    model = tm.model
    was_training = model.training
    model.to(device).eval()
    n = len(pairs)
    ids: list = [None] * n
    ponder: list = [None] * n
    ans: list = [None] * n
    by_len: dict[int, list[int]] = {}
    for i, (s, _) in enumerate(pairs):
        by_len.setdefault(len(s), []).append(i)
    for L, idxs in sorted(by_len.items()):
        for c in range(0, len(idxs), batch_size):
            chunk = idxs[c: c + batch_size]
            max_new = max(len(pairs[i][1]) for i in chunk) + slack
            gen_BN, p_BP = tm.greedy([pairs[i][0] for i in chunk], max_new, device)
            for b, i in enumerate(chunk):
                row = gen_BN[b].tolist()
                k = row.index(tm.eos) if tm.eos in row else len(row)
                ids[i] = row[:k]
                if p_BP is not None:
                    # positions processed for this example: prompt + SEP + tokens fed back
                    used = p_BP.shape[1] - gen_BN.shape[1] + min(k + 1, gen_BN.shape[1])
                    ponder[i] = p_BP[b, :used].float().cpu()
                    ans[i] = float(p_BP[b, tm.answer_position(L)])
    model.train(was_training)
    return Decoded(ids, ponder, ans)


def length_metrics(examples: Sequence[Example], preds: Sequence[str],
                   ponder: Sequence[torch.Tensor | None]) -> dict[int, dict]:
    """``per_length_metrics`` plus, for ACT models, ``ponder_mean``/``ponder_std``
    over all positions of that length's examples."""
    res = per_length_metrics(examples, preds)
    if ponder and ponder[0] is not None:
        for L in res:
            vals = torch.cat([p for ex, p in zip(examples, ponder) if ex.length == L])
            res[L]["ponder_mean"], res[L]["ponder_std"] = mean_std(vals.tolist())
    return res


# ----------------------------------------------------------------------------- runs
def fit_model_config(model_cfg: ModelConfig, vocab_size: int, max_len: int) -> ModelConfig:
    """The config with the task's vocabulary and a max_seq_len covering ``max_len``."""
    return model_cfg.replace(vocab_size=vocab_size, max_seq_len=max(model_cfg.max_seq_len, max_len))


def _seq_len(pairs: Sequence[Pair]) -> int:
    return max(len(s) + len(t) + 1 for s, t in pairs)


def auto_offset(train_pairs_: Sequence[Pair], test_pairs: Sequence[Pair], seq2seq: bool = False) -> int:
    """Offset range so that training batches reach every position used at test time:
    of the joined sequence (decoder-only), or of the longer of source and target
    (encoder-decoder, where each side counts its own positions)."""
    if seq2seq:
        return max(0, max(len(s) for s, _ in test_pairs) - max(len(s) for s, _ in train_pairs_),
                   max(len(t) for _, t in test_pairs) - max(len(t) for _, t in train_pairs_))
    return max(0, _seq_len(test_pairs) - _seq_len(train_pairs_))


def run_examples(model_cfg: ModelConfig, train: Sequence[Example], test: Sequence[Example],
                 rc: TaskRunConfig, vocab=None, arch: str | None = None,
                 log: Callable[[dict], None] | None = None) -> dict:
    """Train a fresh model (seed ``rc.seed``) on ``train``, greedy-decode ``test``.
    Returns ``{"per_length": {L: {char_acc, seq_acc, n[, ponder_mean, ponder_std]}},
    "char_acc", "seq_acc", "train_log", "params", "seconds", "preds"}``."""
    vocab = vocab or CharVocab.for_examples(list(train) + list(test))
    tr, te = encode_pairs(train, vocab), encode_pairs(test, vocab)
    cfg = fit_model_config(model_cfg, len(vocab), max(_seq_len(tr), _seq_len(te)) + rc.max_offset)
    tm = build_task_model(cfg, rc.seed, arch)
    t0 = time.perf_counter()
    train_log = train_pairs(tm, tr, rc, log)
    t_train = time.perf_counter() - t0
    dec = decode_pairs(tm, te, rc.eval_batch_size, rc.device)
    preds = [vocab.decode(ids) for ids in dec.ids]
    per_len = length_metrics(test, preds, dec.ponder)
    from .metrics import char_accuracy, sequence_accuracy

    res = {"per_length": per_len, "char_acc": char_accuracy(preds, [e.target for e in test]),
           "seq_acc": sequence_accuracy(preds, [e.target for e in test]),
           "train_log": train_log, "final_loss": train_log[-1]["loss"],
           "params": sum(p.numel() for p in tm.model.parameters()),
           "train_seconds": t_train, "seconds": time.perf_counter() - t0,
           "model": cfg.to_dict(), "preds": preds, "decoded": dec}
    return res


def algorithmic_data(spec: TaskSpec, n_train: int, n_test: int, seed: int,
                     test_seed: int = 10_000) -> tuple[list[Example], list[Example]]:
    """Training pool for ``seed``; the test set is fixed (``test_seed``) so every model
    and seed is scored on the same examples."""
    return spec.train(n_train, seed), spec.test(n_test, test_seed)


def split_examples(examples: Sequence[Example], test_fraction: float = 0.1,
                   seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Deterministic train/test split of a user's examples (at least one of each)."""
    if len(examples) < 2:
        raise ConfigError(f"need at least 2 examples to hold some out for testing, got {len(examples)}; "
                          "add examples or pass a separate test file")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(examples), generator=g).tolist()
    k = min(len(examples) - 1, max(1, round(test_fraction * len(examples))))
    test_idx = set(perm[:k])
    return ([e for i, e in enumerate(examples) if i not in test_idx],
            [e for i, e in enumerate(examples) if i in test_idx])


def summarize_seeds(results: Sequence[dict]) -> dict:
    """Mean and std across seeds per length and overall."""
    out: dict = {"per_length": {}}
    lengths = sorted(results[0]["per_length"])
    keys = [k for k in ("char_acc", "seq_acc", "ponder_mean", "ponder_std")
            if k in results[0]["per_length"][lengths[0]]]
    for L in lengths:
        row = {"n": results[0]["per_length"][L]["n"]}
        for k in keys:
            row[k], row[k + "_seed_std"] = mean_std(r["per_length"][L][k] for r in results)
        out["per_length"][L] = row
    for k in ("char_acc", "seq_acc", "final_loss"):
        out[k], out[k + "_seed_std"] = mean_std(r[k] for r in results)
    return out


def format_table(summary: dict, title: str = "") -> str:
    rows = summary["per_length"]
    has_p = any("ponder_mean" in r for r in rows.values())
    head = f"{'length':>6} {'n':>5} {'char acc':>15} {'seq acc':>15}" + (f" {'ponder/pos':>13}" if has_p else "")
    lines = ([title] if title else []) + [head]
    for L, r in rows.items():
        s = (f"{L:>6} {r['n']:>5} {r['char_acc']:>8.3f} ±{r['char_acc_seed_std']:.3f}"
             f" {r['seq_acc']:>8.3f} ±{r['seq_acc_seed_std']:.3f}")
        if has_p:
            s += f" {r['ponder_mean']:>6.2f} ±{r['ponder_std']:.2f}"
        lines.append(s)
    lines.append(f"{'all':>6} {'':>5} {summary['char_acc']:>8.3f} ±{summary['char_acc_seed_std']:.3f}"
                 f" {summary['seq_acc']:>8.3f} ±{summary['seq_acc_seed_std']:.3f}")
    return "\n".join(lines)


def plot_accuracy(per_seed: Sequence[dict], path: Path, title: str) -> bool:
    """Char and sequence accuracy against test length (one line per seed); False when
    matplotlib is missing (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ..data import atomic_write_bytes
    import io

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, key, name in zip(axes, ("char_acc", "seq_acc"), ("character accuracy", "sequence accuracy")):
        for r in per_seed:
            Ls = sorted(r["per_length"])
            ax.plot(Ls, [r["per_length"][L][key] for L in Ls], "o-", label=f"seed {r['seed']}")
        ax.set_xlabel("test length")
        ax.set_title(name)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return True


# ----------------------------------------------------------------------------- commands
def parse_task(text: str) -> tuple[str, Path | None]:
    """``"copy"`` -> ("copy", None); ``"jsonl:PATH"`` -> ("jsonl", PATH)."""
    from .algorithmic import TASKS

    if text.startswith("jsonl:"):
        path = Path(text[len("jsonl:"):])
        if not str(path):
            raise ConfigError("--task jsonl:PATH needs a path, e.g. --task jsonl:my_pairs.jsonl")
        return "jsonl", path
    if text not in TASKS:
        raise ConfigError(f"unknown task {text!r}; choose {', '.join(TASKS)} or jsonl:PATH")
    return text, None


def task_model_config(arch: str | None, preset: str | None, overrides: dict | None = None
                      ) -> tuple[ModelConfig, str | None]:
    """``(model config, seq2seq arch or None)`` for the task commands: ``--preset`` wins;
    else ``--arch X`` uses the ``X-tiny`` preset, or another ``*-tiny`` preset of that
    arch (``three_phase`` -> ``3pt-tiny``)."""
    from ..config import PRESETS

    overrides = overrides or {}
    if arch in SEQ2SEQ_ARCHS:
        if preset is None and arch == "transformer-seq2seq":
            # rope-tiny with the UT presets' embedding scale (sqrt(d) * N(0, 1/d)): the
            # sinusoid added at the embedding would otherwise drown 0.02-std embeddings
            d = ModelConfig.from_preset("rope-tiny").d_model
            overrides = {"embed_scale": True, "embed_init_std": d ** -0.5, **overrides}
        base = preset or ("universal-tiny" if arch.startswith("universal") else "rope-tiny")
        return ModelConfig.from_preset(base, **overrides), arch
    name = preset or f"{arch or 'rope'}-tiny"
    if preset is None and name not in PRESETS:  # e.g. three_phase -> 3pt-tiny
        name = next((p for p, d in PRESETS.items() if p.endswith("-tiny") and d.get("arch") == arch), name)
    if name not in PRESETS:
        raise ConfigError(f"no preset {name!r} for --arch {arch}; pass --preset (phaseloop params --all "
                          f"lists them) or one of the archs with a -tiny preset")
    cfg = ModelConfig.from_preset(name, **overrides)
    if arch is not None and cfg.arch != arch:
        raise ConfigError(f"--preset {name} is arch {cfg.arch!r}, not --arch {arch!r}; drop one of them")
    return cfg, None


def run_task(task: str, model_cfg: ModelConfig, rc: TaskRunConfig, seeds: Sequence[int],
             train_lengths="1-20", test_lengths="40,80", out_dir=None, n_test: int = 100,
             n_train: int | None = None, test_file=None, offsets: str | int = 0,
             arch: str | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Run one task for several seeds (``n_test`` test examples per test length); write ``metrics.json`` and
    ``accuracy_vs_length.png`` into ``out_dir`` (when given). ``task``: an algorithmic
    task name or ``jsonl:PATH`` (held-out 10% test split unless ``test_file``).
    ``offsets``: max random start offset in training, or ``"auto"`` (reach the longest
    test position)."""
    from .jsonl import load_jsonl

    name, path = parse_task(task)
    _check_out_dir(out_dir)
    per_seed = []
    for seed in seeds:
        if name == "jsonl":
            data = load_jsonl(path)
            if test_file is not None:
                train, test = data, load_jsonl(test_file)
            else:
                train, test = split_examples(data, 0.1, seed=0)
        else:
            spec = TaskSpec(name, train_lengths, test_lengths)
            n_lens = len(parse_lengths(test_lengths)) if isinstance(test_lengths, str) else len(test_lengths)
            train, test = algorithmic_data(spec, n_train or rc.steps * rc.batch_size, n_test * n_lens, seed)
        vocab = CharVocab.for_examples(list(train) + list(test))
        max_off = offsets
        if offsets == "auto":
            max_off = auto_offset(encode_pairs(train, vocab), encode_pairs(test, vocab), arch in SEQ2SEQ_ARCHS)
        rcs = rc.replace(seed=seed, max_offset=int(max_off))
        if log:
            log(f"[seed {seed}] training {arch or model_cfg.arch} on {task}: {len(train)} examples, "
                f"{rcs.steps} steps, max offset {rcs.max_offset}")
        res = run_examples(model_cfg, train, test, rcs, vocab, arch,
                           (lambda r: log(f"  step {r['step']:>5} loss {r['loss']:.4f}")) if log else None)
        res.pop("decoded")
        res["seed"], res["max_offset"] = seed, rcs.max_offset
        res["examples"] = [{"input": e.input, "target": e.target, "pred": p}
                           for e, p in list(zip(test, res.pop("preds")))[:5]]
        per_seed.append(res)
    summary = summarize_seeds(per_seed)
    out = {"task": task, "arch": arch or model_cfg.arch, "seeds": list(seeds),
           "train_lengths": str(train_lengths), "test_lengths": str(test_lengths),
           "run_config": asdict(rc), "summary": summary, "per_seed": per_seed}
    if out_dir is not None:
        from ..checkpoint import write_json

        out_dir = Path(out_dir)
        write_json(out_dir / "metrics.json", _jsonable(out))
        out["plot"] = plot_accuracy(per_seed, out_dir / "accuracy_vs_length.png",
                                    f"{task} - {arch or model_cfg.arch}")
    return out


def _check_out_dir(out_dir) -> None:
    """Results never overwrite an earlier run (as ``phaseloop train``)."""
    if out_dir is not None and Path(out_dir).exists() and any(Path(out_dir).iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose another --out")


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- bAbI
def babi_pairs(examples: Sequence[BabiExample], max_sentences: int | None) -> list[Example]:
    """bAbI questions as ``Example(prompt, answer, length=n_supporting)``."""
    out = []
    for ex in examples:
        prompt, answer = format_example(ex, max_sentences)
        out.append(Example(prompt, answer, ex.n_supporting))
    return out


def run_babi(model_cfg: ModelConfig, data_dir, tasks: Sequence[int], rc: TaskRunConfig,
             joint: bool = False, max_sentences: int | None = 20, arch: str | None = None,
             log: Callable[[dict], None] | None = None, max_test: int | None = None) -> dict:
    """Train per task (one model each) or jointly (one model on all tasks' training
    questions) and score the test questions: error per task, failed tasks (> 5%),
    and for ACT models ponder time by number of supporting facts per task.
    ``max_sentences``: keep the last k story sentences (None: all); ``max_test``: score
    only the first k test questions per task (None: all)."""
    train = {t: load_babi(data_dir, t, "train") for t in tasks}
    test = {t: load_babi(data_dir, t, "test")[:max_test] for t in tasks}
    texts = [s for d in (train, test) for exs in d.values() for e in babi_pairs(exs, max_sentences)
             for s in (e.input, e.target)]
    vocab = WordVocab.for_texts(texts)
    groups = [list(tasks)] if joint else [[t] for t in tasks]
    errors, ponder, ans_ponder, covered, seconds, params = {}, {}, {}, {}, 0.0, 0
    for grp in groups:
        tr = [e for t in grp for e in babi_pairs(train[t], max_sentences)]
        te_raw = [e for t in grp for e in test[t]]
        te = babi_pairs(te_raw, max_sentences)
        res = run_examples(model_cfg, tr, te, rc, vocab, arch, log)
        seconds += res["seconds"]
        params = res["params"]
        errors.update(task_error(res["preds"], te_raw))
        dec = res["decoded"]
        for t in grp:
            sel = [i for i, e in enumerate(te_raw) if e.task == t]
            kept = [e for e in (te_raw[i] for i in sel)]
            covered[t] = _supporting_kept(kept, max_sentences)
            if dec.ponder[sel[0]] is not None:
                ponder[t] = ponder_by_supporting([dec.ponder[i] for i in sel], kept)
                ans_ponder[t] = ponder_by_supporting([dec.answer_ponder[i] for i in sel], kept)
    return {"errors": errors, "failed": failed_tasks(errors), "mean_error": sum(errors.values()) / len(errors),
            "ponder_by_supporting": ponder, "answer_ponder_by_supporting": ans_ponder,
            "supporting_in_window": covered, "vocab_size": len(vocab), "params": params,
            "seconds": seconds}


def run_babi_seeds(model_cfg: ModelConfig, data_dir, tasks: Sequence[int], rc: TaskRunConfig,
                   seeds: Sequence[int], joint: bool = False, max_sentences: int | None = 20,
                   out_dir=None, arch: str | None = None,
                   log: Callable[[str], None] | None = print, max_test: int | None = None) -> dict:
    """``run_babi`` for several seeds; summary (mean +- std over seeds) of error per
    task and of ponder time per task and number of supporting facts; writes
    ``metrics.json`` into ``out_dir`` when given."""
    _check_out_dir(out_dir)
    per_seed = []
    for seed in seeds:
        if log:
            log(f"[seed {seed}] bAbI tasks {','.join(map(str, tasks))} "
                f"({'joint' if joint else 'per task'}), {rc.steps} steps")
        res = run_babi(model_cfg, data_dir, tasks, rc.replace(seed=seed), joint, max_sentences, arch,
                       (lambda r: log(f"  step {r['step']:>5} loss {r['loss']:.4f}")) if log else None,
                       max_test)
        res["seed"] = seed
        per_seed.append(res)
    summary: dict = {"errors": {}, "ponder": {}, "answer_ponder": {}}
    for t in tasks:
        summary["errors"][t] = mean_std(r["errors"][t] for r in per_seed)
        for key, src in (("ponder", "ponder_by_supporting"), ("answer_ponder", "answer_ponder_by_supporting")):
            if t in per_seed[0][src]:
                summary[key][t] = {k: tuple(mean_std(r[src][t][k][i] for r in per_seed) for i in (0, 1))
                                   for k in per_seed[0][src][t]}
    summary["failed"] = mean_std(len(r["failed"]) for r in per_seed)
    summary["mean_error"] = mean_std(r["mean_error"] for r in per_seed)
    out = {"tasks": list(tasks), "arch": arch or model_cfg.arch, "joint": joint, "seeds": list(seeds),
           "max_sentences": max_sentences, "data_dir": str(data_dir), "run_config": asdict(rc),
           "summary": summary, "per_seed": per_seed}
    if out_dir is not None:
        from ..checkpoint import write_json

        write_json(Path(out_dir) / "metrics.json", _jsonable(out))
    return out


def format_babi_table(out: dict) -> str:
    s = out["summary"]
    lines = [f"{'task':>4} {'error':>15} {'window':>7}  ponder by supporting facts: mean±std over questions"
             " of the per-question mean over positions; at the answer position"]
    for t in out["tasks"]:
        m, sd = s["errors"][t]
        cov = sum(r["supporting_in_window"][t] for r in out["per_seed"]) / len(out["per_seed"])
        p = s["ponder"].get(t, {})
        a = s["answer_ponder"].get(t, {})
        pond = "  ".join(f"{k} fact{'s' if int(k) > 1 else ''}: {v[0][0]:.2f}±{v[1][0]:.2f}; "
                         f"{a[k][0][0]:.2f}±{a[k][1][0]:.2f}" for k, v in p.items()) or "-"
        lines.append(f"{t:>4} {m:>8.3f} ±{sd:.3f} {cov:>7.2f}  {pond}")
    fm, fs = s["failed"]
    em, es = s["mean_error"]
    lines.append(f"mean error {em:.3f} ±{es:.3f}; failed tasks (>5% error) {fm:.1f} ±{fs:.1f} "
                 f"of {len(out['tasks'])}; window = fraction of test questions whose supporting facts "
                 "are inside the story window")
    return "\n".join(lines)


def _supporting_kept(examples: Sequence[BabiExample], max_sentences: int | None) -> float:
    """Fraction of questions whose supporting facts are all inside the story window."""
    if max_sentences is None:
        return 1.0
    ok = sum(all(i >= len(e.story) - max_sentences for i in e.supporting_index) for e in examples)
    return ok / len(examples)


__all__ = ["TaskRunConfig", "WordVocab", "decoder_batch", "DecoderTaskModel", "Seq2SeqTaskModel",
           "build_task_model", "train_pairs", "decode_pairs", "length_metrics", "run_examples",
           "algorithmic_data", "split_examples", "summarize_seeds", "format_table", "plot_accuracy",
           "run_babi", "babi_pairs", "auto_offset", "SEQ2SEQ_ARCHS", "encode_pairs",
           "fit_model_config", "parse_task", "run_task", "task_model_config", "run_babi_seeds",
           "format_babi_table"]
