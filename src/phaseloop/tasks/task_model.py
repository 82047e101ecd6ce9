"""Task models: a prompt -> answer interface over the library's models, the batches they
train on, training through the one engine, and greedy decoding.

Two model families, one interface (``loss(pairs, offset, device)``, ``greedy(srcs, max_new)``):

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
change is needed. Caveats: RoPE is relative, so the shift changes nothing for a
RoPE-only model (only absolute signals, e.g. the UT's sinusoid, see it); and a cached
forward runs an ACT trunk for all its max steps (same outputs, more compute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phaseloop import registry
from phaseloop.archs.seq2seq import collate
from phaseloop.config import ModelConfig
from phaseloop.data.tokenizer import BOS, EOS, PAD, SEP
from phaseloop.engine import RunFolder, TrainConfig, Trainer
from phaseloop.errors import ConfigError
from phaseloop.layers import KVCache
from phaseloop.model import build_model
from phaseloop.tasks.algorithmic import Example, position_offsets

Pair = tuple[list[int], list[int]]  # (source ids, target ids ending in EOS)


def is_seq2seq(arch: str | None) -> bool:
    """Whether a task run's ``--arch`` names an encoder-decoder (``ArchSpec.seq2seq_name``)."""
    return arch is not None and arch in registry.seq2seq_archs()


def encode_pairs(examples: Sequence[Example], vocab) -> list[Pair]:
    return [(vocab.encode(ex.input), vocab.encode(ex.target, add_eos=True)) for ex in examples]


def decoder_batch(pairs: Sequence[Pair], pad: int = PAD, sep: int = SEP):
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

    def __init__(self, model):
        self.model = model

    def loss(self, pairs: Sequence[Pair], offset: int = 0, device="cpu"):
        idx_BT, tgt_BT = decoder_batch(pairs)
        # An empty cache at pos=offset starts the sequence at that absolute position.
        cache = KVCache(pos=offset) if offset else None
        return self.model(idx_BT.to(device), tgt_BT.to(device), cache=cache)

    def greedy(self, srcs: Sequence[list[int]], max_new: int, device="cpu"):
        """Greedy answers for prompts of equal length, with the KV cache. Returns the
        generated ids [B, <= max_new] and the ponder time [B, positions processed] (or
        None); position j of the ponder row is prompt token j, then SEP, then the fed
        back answer tokens."""
        ponder: list = []
        prompt = torch.tensor([s + [SEP] for s in srcs], device=device)
        out = self.model.generate(prompt, max_new, temperature=0.0, eos_id=EOS,
                                  on_output=lambda o: ponder.append(o.stats.get("ponder_time")))
        return out[:, prompt.shape[1]:], _ponder_rows(ponder)

    def answer_position(self, src_len: int) -> int:
        return src_len  # SEP: the position that predicts the first answer token


class Seq2SeqTaskModel:
    """An encoder-decoder of ``seq2seq.py`` (vanilla Transformer, UT, UT+ACT): source ->
    BOS + target + EOS, teacher-forced loss on the target (``seq2seq.collate``). Random
    position offsets: ``offset`` PAD tokens before the source (PAD keys are masked out of
    attention, so the real tokens just sit at positions offset.. ; ACT also counts the
    pads in its ponder loss) and an empty ``KVCache`` at pos=offset for the decoder.
    Ponder rows are the encoder positions, then the decoder positions (BOS and the
    fed-back answer tokens)."""

    def __init__(self, model):
        self.model = model

    def loss(self, pairs: Sequence[Pair], offset: int = 0, device="cpu"):
        src_BS, tgt_in_BT, tgt_BT = collate([(s, t[:-1]) for s, t in pairs], device=device)
        if offset:
            src_BS = F.pad(src_BS, (offset, 0), value=PAD)
        return self.model(src_BS, tgt_in_BT, tgt_BT, cache=KVCache(pos=offset) if offset else None)

    def greedy(self, srcs: Sequence[list[int]], max_new: int, device="cpu"):
        ponder: list = []  # the encoder's context first, then each decoder output
        stat = lambda o: ponder.append(o.stats.get("ponder_time", o.stats.get("decoder_ponder_time")))
        gen = self.model.generate(torch.tensor(srcs, device=device), max_new, bos_id=BOS,
                                  eos_id=EOS, on_output=stat)
        return gen, (_ponder_rows(ponder) if ponder[0] is not None else None)

    def answer_position(self, src_len: int) -> int:
        return src_len  # the decoder's BOS position predicts the first answer token


def _ponder_rows(pieces: list) -> torch.Tensor | None:
    """Ponder times of the positions processed, in order, or None without ACT."""
    pieces = [p for p in pieces if p is not None]
    return torch.cat(pieces, 1) if pieces else None


def task_model_class(arch: str | None):
    return Seq2SeqTaskModel if is_seq2seq(arch) else DecoderTaskModel


def build_task_model(model_cfg: ModelConfig, arch: str | None = None):
    """The model of a task run. An encoder-decoder ``arch`` (``is_seq2seq``: e.g.
    ``transformer-seq2seq``, ``universal-seq2seq``) builds that architecture's
    ``ArchSpec.seq2seq``, from a config whose own encoder-decoder it is (the baseline's
    for archs without one; ``act=True`` gives UT+ACT on both sides); otherwise a
    ``DecoderLM`` of ``model_cfg.arch``. Weights come from torch's RNG (the engine seeds it)."""
    if is_seq2seq(arch):
        spec = registry.seq2seq_archs()[arch]
        own = model_cfg.spec.seq2seq or registry.get_arch(registry.default_arch()).seq2seq
        if own is not spec.seq2seq:
            raise ConfigError(f"--arch {arch} needs a model config of arch {spec.name!r} (or one "
                              f"without its own encoder-decoder), got arch={model_cfg.arch!r}; change --preset")
        return spec.seq2seq(model_cfg, pad_id=PAD)
    return build_model(model_cfg)


# ----------------------------------------------------------------------------- train
# Task runs' defaults of the engine's TrainConfig (any field can be overridden).
TASK_TRAIN = dict(steps=400, batch_size=32, lr=2e-3, warmup_steps=40, weight_decay=0.01, beta2=0.98,
                  log_every=50, ckpt_every=100, device="cpu")


def task_train_config(**overrides) -> TrainConfig:
    return TrainConfig.from_dict({**TASK_TRAIN, **overrides})


class PairBatches:
    """Batches of task pairs drawn epoch-wise without replacement (a fresh permutation
    each epoch), each with a random start offset in [0, max_offset]. The generator, the
    permutation and the cursor are the data position a checkpoint keeps."""

    def __init__(self, pairs: Sequence[Pair], batch_size: int, seed: int, max_offset: int = 0):
        if not pairs:
            raise ConfigError("no training examples; give at least one")
        self.pairs, self.batch_size, self.max_offset = pairs, batch_size, max_offset
        self.g = torch.Generator().manual_seed(seed)
        self.order, self.cursor = torch.randperm(len(pairs), generator=self.g), 0

    def next(self) -> tuple[list[Pair], int]:
        if self.cursor + self.batch_size > len(self.order):
            self.order, self.cursor = torch.randperm(len(self.pairs), generator=self.g), 0
        batch = [self.pairs[i] for i in self.order[self.cursor: self.cursor + self.batch_size].tolist()]
        self.cursor += self.batch_size
        offset = int(position_offsets(1, self.max_offset, self.g)[0]) if self.max_offset else 0
        return batch, offset

    def state(self) -> dict[str, torch.Tensor]:
        return {"generator": self.g.get_state(), "order": self.order,
                "cursor": torch.tensor([self.cursor])}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.g.set_state(state["generator"])
        self.order, self.cursor = state["order"], int(state["cursor"][0])


def train_pairs(model_cfg: ModelConfig, pairs: Sequence[Pair], tc: TrainConfig, arch: str | None = None,
                max_offset: int = 0, run: RunFolder | None = None,
                log: Callable[[dict], None] | None = None) -> Trainer:
    """Train a fresh task model (seed ``tc.seed``) on ``pairs`` through the engine; with
    ``run`` it checkpoints and resumes in that folder. Returns the finished Trainer
    (``.model``, ``.records``)."""
    if tc.doc_mask or tc.doc_positions:
        raise ConfigError.invalid("doc_mask / doc_positions apply to LM runs on a corpus "
                          "(windows spanning documents); a task's examples are one sequence each: drop them",
                          "train config")
    cls = task_model_class(arch)
    trainer = Trainer(lambda: build_task_model(model_cfg, arch), tc,
                      PairBatches(pairs, tc.batch_size, tc.seed, max_offset),
                      lambda model, batch, device: cls(model).loss(*batch, device), run=run,
                      on_step=(lambda step, rec: log(rec)) if log else None)
    trainer.fit()
    return trainer


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
                cut = min(len(pairs[i][1]) + slack, gen_BN.shape[1])  # its own budget, whatever the chunk's
                row = gen_BN[b, :cut].tolist()
                k = row.index(EOS) if EOS in row else len(row)
                ids[i] = row[:k]
                if p_BP is not None:
                    # positions processed for this example: prompt + SEP + tokens fed back
                    used = p_BP.shape[1] - gen_BN.shape[1] + min(k + 1, cut)
                    ponder[i] = p_BP[b, :used].float().cpu()
                    ans[i] = float(p_BP[b, tm.answer_position(L)])
    model.train(was_training)
    return Decoded(ids, ponder, ans)
