"""The one training engine (phaseloop.engine): an AdamW step by hand, accumulation,
auxiliary losses, in-memory runs, and resume of a task run through it."""

import json
import math

import pytest
import torch
from torch import nn

from phaseloop import ConfigError
from phaseloop.engine import RunFolder, TrainConfig, Trainer, lr_at, read_metrics
from phaseloop.engine.weighting import ignore_targets
from phaseloop.model import ModelOutput
from phaseloop.tasks import TaskSpec
from phaseloop.tasks.runner import algorithmic_data, run_examples, task_model_config
from phaseloop.tasks.task_model import PairBatches, task_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM(nn.Module):
    """logits = (x W^T) * g over a [B, T, 3] input: one matrix (decayed) and one gain
    vector (not decayed); optionally an auxiliary loss on g."""

    def __init__(self, aux: float = 0.0):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.g = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.aux = aux

    def forward(self, x, y):
        out = ModelOutput(logits=(x @ self.W.t()) * self.g)
        if self.aux:
            out.aux_losses["gain_penalty"] = self.aux * self.g.square().sum()
        return out.add_loss(y)


class FixedBatches:
    """Deterministic batches from a generator, with the engine's state protocol."""

    def __init__(self, batch_size: int, seed: int = 0):
        self.batch_size, self.g = batch_size, torch.Generator().manual_seed(seed)

    def next(self):
        x = torch.randn(self.batch_size, 5, 3, generator=self.g, dtype=torch.float64)
        y = torch.randint(0, 4, (self.batch_size, 5), generator=self.g)
        return x, y

    def state(self):
        return {"generator": self.g.get_state()}

    def set_state(self, state):
        self.g.set_state(state["generator"])


def loss_fn(model, batch, device):
    return model(*batch)


TC = dict(steps=3, batch_size=4, lr=0.1, warmup_steps=2, weight_decay=0.1, beta1=0.9, beta2=0.95,
          grad_clip=0.5, log_every=1, device="cpu")


@pytest.mark.parametrize("decay", ["matrices", "all"])
def test_one_step_equals_a_hand_computed_adamw_step(decay):
    """Step 1: lr = lr * 1/warmup; gradients clipped to total norm 0.5; AdamW with bias
    correction, decoupled decay on the matrix only (decay="matrices") or on the gain
    vector too (decay="all"), eps 1e-8."""
    tc = TrainConfig(**{**TC, "steps": 1, "decay": decay})
    torch.manual_seed(0)
    ref = TinyLM()
    W0, g0 = ref.W.detach().clone(), ref.g.detach().clone()
    x, y = FixedBatches(4).next()
    ref(x, y).loss.backward()
    grads = [ref.W.grad.clone(), ref.g.grad.clone()]
    norm = torch.sqrt(sum(gr.square().sum() for gr in grads))
    assert norm > tc.grad_clip  # the clip is exercised
    grads = [gr * tc.grad_clip / (norm + 1e-6) for gr in grads]
    lr = tc.lr * 1 / tc.warmup_steps
    want = []
    gain_wd = tc.weight_decay if decay == "all" else 0.0
    for p0, gr, wd in ((W0, grads[0], tc.weight_decay), (g0, grads[1], gain_wd)):
        m = (1 - tc.beta1) * gr / (1 - tc.beta1)
        v = (1 - tc.beta2) * gr.square() / (1 - tc.beta2)
        want.append(p0 * (1 - lr * wd) - lr * m / (v.sqrt() + 1e-8))

    trainer = Trainer(TinyLM, tc, FixedBatches(4), loss_fn).setup()  # seeds 0, then builds: same init
    torch.testing.assert_close(trainer.model.W.detach(), W0, rtol=0, atol=0)
    trainer.fit()
    torch.testing.assert_close(trainer.model.W.detach(), want[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(trainer.model.g.detach(), want[1], rtol=1e-12, atol=1e-14)
    rec = trainer.records[0]
    assert rec["lr"] == pytest.approx(lr) and rec["grad_norm"] == pytest.approx(float(norm))
    assert rec["tokens"] == 4 * 5


def test_loss_ignore_id_leaves_those_targets_out():
    """loss_ignore_id=3: the logged loss is the cross-entropy over the other targets
    (by hand), and the step is the one on batches whose 3s were -100 from the start."""
    x, y = FixedBatches(4).next()
    keep = y != 3
    assert 0 < (~keep).sum() < keep.sum()  # some targets are ignored, most are not
    torch.manual_seed(0)
    ref = TinyLM()
    with torch.no_grad():
        logp = ((x @ ref.W.t()) * ref.g).log_softmax(-1)
        want = -logp.gather(-1, y[..., None])[..., 0][keep].mean()

    class Masked(FixedBatches):
        def next(self):
            x, y = super().next()
            return x, y.masked_fill(y == 3, -100)

    one = {**TC, "steps": 1}
    t = Trainer(TinyLM, TrainConfig(**one, loss_ignore_id=3), FixedBatches(4), loss_fn)
    t.fit()
    assert t.records[0]["loss"] == pytest.approx(float(want), rel=1e-12)
    masked = Trainer(TinyLM, TrainConfig(**one), Masked(4), loss_fn)
    masked.fit()
    torch.testing.assert_close(t.model.W, masked.model.W, rtol=0, atol=0)
    plain = Trainer(TinyLM, TrainConfig(**one), FixedBatches(4), loss_fn)
    plain.fit()
    assert plain.records[0]["loss"] != pytest.approx(t.records[0]["loss"], rel=1e-6)


def test_loss_ignore_id_needs_inputs_targets_batches():
    pairs = ([([5, 6], [7, 1])], 0)  # a task run's (pairs, offset) batch
    assert ignore_targets(pairs, None) is pairs
    with pytest.raises(ConfigError, match="loss_ignore_id=0: applies to the .inputs, targets. batches"):
        ignore_targets(pairs, 0)


@pytest.mark.parametrize("kw, msg", [
    (dict(decay="none"), "decay='none': choose matrices"),
    (dict(loss_ignore_id=-1), "loss_ignore_id=-1: must be an integer >= 0 or null"),
    (dict(loss_ignore_id=True), "loss_ignore_id=True"),
])
def test_invalid_decay_and_loss_ignore_id(kw, msg):
    with pytest.raises(ConfigError, match=None) as ei:
        TrainConfig(**kw)
    assert msg in str(ei.value) and "\n" not in str(ei.value)


def test_accumulation_equals_the_bigger_batch_and_logs_aux_losses():
    """2 micro-batches of 2 = 1 batch of 4 (the same rows: the generator draws them in
    the same order), for the weights and for the logged loss and auxiliary loss."""
    runs = {}
    for bs, acc in ((4, 1), (2, 2)):
        class Split(FixedBatches):  # draw 4 rows, hand them out in micro-batches of bs
            def __init__(self):
                super().__init__(4)
                self.rows, self.i = None, 0

            def next(self, bs=bs):
                if self.rows is None or self.i == 4:
                    self.rows, self.i = super().next(), 0
                x, y = (t[self.i: self.i + bs] for t in self.rows)
                self.i += bs
                return x, y
        tc = TrainConfig(**{**TC, "batch_size": bs, "grad_accum": acc})
        t = Trainer(lambda: TinyLM(aux=0.01), tc, Split(), loss_fn)
        t.fit()
        runs[acc] = t
    a, b = runs[1], runs[2]
    torch.testing.assert_close(a.model.W, b.model.W, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.model.g, b.model.g, rtol=1e-12, atol=1e-14)
    for ra, rb in zip(a.records, b.records):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-12)
        assert ra["gain_penalty"] == pytest.approx(rb["gain_penalty"], rel=1e-12) and ra["gain_penalty"] > 0
        assert ra["tokens"] == rb["tokens"]


def test_schedule_reaches_the_floor_and_in_memory_runs_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tc = TrainConfig(**{**TC, "steps": 6, "warmup_steps": 1, "min_lr_ratio": 0.1})
    t = Trainer(TinyLM, tc, FixedBatches(4), loss_fn)
    s = t.fit()
    assert [r["lr"] for r in t.records] == pytest.approx([lr_at(i, tc) for i in range(6)])
    assert lr_at(6, tc) == pytest.approx(0.01) and s["finished"] and s["run"] is None
    assert not list(tmp_path.iterdir())


def test_engine_run_folder_resume_is_exact(tmp_path):
    """Interrupted after step 2 (no checkpoint there: ckpt_every 2 -> last at 2) and resumed
    = uninterrupted, records and weights."""
    tc = TrainConfig(**{**TC, "steps": 5, "ckpt_every": 2})
    cfg = {"train": tc.to_dict()}
    full = Trainer(TinyLM, tc, FixedBatches(4), loss_fn, run=RunFolder.open(tmp_path / "full", cfg))
    full.fit()
    part = Trainer(TinyLM, tc, FixedBatches(4), loss_fn, run=RunFolder.open(tmp_path / "part", cfg))
    part.fit(stop_after=3)  # checkpoint at 2, record of step 3 logged then lost
    again = Trainer(TinyLM, tc, FixedBatches(4), loss_fn,
                    run=RunFolder.open(tmp_path / "part", cfg, resume=True))
    assert again.step == 0  # the constructor only stores; setup() restores the checkpoint
    again.setup()
    assert again.step == 2
    again.fit()
    keys = ("step", "loss", "lr", "grad_norm", "tokens")
    got, want = ([{k: r[k] for k in keys} for r in read_metrics(tmp_path / d)] for d in ("part", "full"))
    assert got == want  # exact: float64 model, same batches, same optimiser state
    torch.testing.assert_close(again.model.W, full.model.W, rtol=0, atol=0)


def test_pair_batches_state_round_trip():
    pairs = [([i], [i, 1]) for i in range(10)]
    a = PairBatches(pairs, 3, seed=1, max_offset=5)
    for _ in range(4):
        a.next()
    b = PairBatches(pairs, 3, seed=99, max_offset=5)
    b.set_state({k: v.clone() for k, v in a.state().items()})
    for _ in range(7):  # across epoch boundaries (10 pairs, 3 per batch)
        assert a.next() == b.next()


def _run_task(out, stop_at=None, resume=False):
    cfg, _ = task_model_config("universal", None, {"d_model": 32, "n_heads": 2, "n_kv_heads": 2,
                                                   "d_ff": 64, "dropout": 0.1})
    train, test = algorithmic_data(TaskSpec("reverse", (2, 4), [5]), 64, 8, seed=0)
    tc = task_train_config(steps=12, batch_size=8, log_every=1, ckpt_every=5)

    def log(rec):
        if stop_at is not None and rec["step"] == stop_at:
            raise KeyboardInterrupt

    return run_examples(cfg, train, test, tc, log=log, max_offset=3, run_dir=out, resume=resume)


@pytest.mark.parametrize("stop_at", [5, 8])  # at a checkpoint / between checkpoints
def test_task_run_resume_matches_uninterrupted(tmp_path, stop_at):
    """A task run (dropout and random offsets consume RNG) interrupted and resumed ends
    with the metrics, weights and predictions of an uninterrupted run."""
    full = _run_task(tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        _run_task(tmp_path / "part", stop_at=stop_at)
    assert not (tmp_path / "part" / "summary.json").exists()
    res = _run_task(tmp_path / "part", resume=True)
    got, want = read_metrics(tmp_path / "part"), read_metrics(tmp_path / "full")
    assert [r["step"] for r in got] == list(range(1, 13))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)
    assert res["preds"] == full["preds"] and res["final_loss"] == pytest.approx(full["final_loss"], abs=1e-6)
    summary = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert summary["finished"] and math.isclose(summary["char_acc"], full["char_acc"])
    # a finished run resumed again is reloaded, not retrained: the same numbers
    assert _run_task(tmp_path / "part", resume=True)["preds"] == full["preds"]


def test_wsd_schedule_follows_its_formula():
    """Warmup, lr held, then 1-sqrt down to the floor over the last decay_fraction of the
    steps (Hägele et al. 2024): lr_t = floor + (lr - floor)(1 - sqrt((t - S) / (steps - S)))."""
    c = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="wsd")  # S = 80
    want = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 50: 1.0, 79: 1.0, 80: 1.0, 85: 0.55,
            96: 0.1 + 0.9 * (1 - math.sqrt(16 / 20)), 99: 0.1 + 0.9 * (1 - math.sqrt(19 / 20)), 100: 0.1}
    assert {s: lr_at(s, c) for s in want} == pytest.approx(want, rel=1e-12)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 100))
    half = c.replace(decay_fraction=0.5)  # S = 50
    assert lr_at(49, half) == 1.0 and lr_at(75, half) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert [lr_at(s, c.replace(decay_fraction=0.0)) for s in (10, 99)] == [1.0, 1.0]  # no decay
    long = TrainConfig(steps=10, warmup_steps=5, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.9)
    assert lr_at(5, long) == 1.0 and lr_at(7, long) == pytest.approx(1 - math.sqrt(2 / 5))  # decay from warmup's end


def test_cosine_is_the_default_and_wsd_runs_in_the_trainer():
    tc = TrainConfig(**{**TC, "steps": 5, "warmup_steps": 1})
    assert (tc.optimizer, tc.schedule, tc.decay_fraction) == ("adamw", "cosine", 0.2)
    wsd = tc.replace(schedule="wsd", decay_fraction=0.4)
    t = Trainer(TinyLM, wsd, FixedBatches(4), loss_fn)
    t.fit()
    assert [r["lr"] for r in t.records] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.01 + 0.09 * (1 - math.sqrt(0.5))])


@pytest.mark.parametrize("kw, msg", [
    (dict(schedule="linear"), "schedule='linear': choose cosine or wsd"),
    (dict(optimizer="sgd"), "optimizer='sgd': choose adamw"),
    (dict(decay_fraction=0.3), "decay_fraction=0.3: has no effect with schedule='cosine'"),
    (dict(schedule="wsd", decay_fraction=1.5), "decay_fraction=1.5: must be in [0, 1]"),
])
def test_invalid_optimizer_and_schedule(kw, msg):
    with pytest.raises(ConfigError) as ei:
        TrainConfig(**kw)
    assert msg in str(ei.value) and "\n" not in str(ei.value)


def test_registries_take_another_optimizer_and_schedule(monkeypatch):
    """A new entry in OPTIMIZERS / SCHEDULES is a valid TrainConfig value the Trainer uses,
    with no edit to the engine: plain SGD at a halving lr, checked by hand."""
    from phaseloop.engine import OPTIMIZERS, SCHEDULES

    monkeypatch.setitem(OPTIMIZERS, "sgd", lambda model, tc: torch.optim.SGD(model.parameters(), lr=tc.lr))
    monkeypatch.setitem(SCHEDULES, "halving", lambda step, tc: tc.lr / 2 ** step)
    tc = TrainConfig(**{**TC, "steps": 2, "grad_clip": 1e9, "optimizer": "sgd", "schedule": "halving"})
    torch.manual_seed(0)
    ref, batches = TinyLM(), FixedBatches(4)
    for step in range(2):
        ref.zero_grad()
        ref(*batches.next()).loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= tc.lr / 2 ** step * p.grad
    t = Trainer(TinyLM, tc, FixedBatches(4), loss_fn).setup()
    assert type(t.optimizer) is torch.optim.SGD
    t.fit()
    assert [r["lr"] for r in t.records] == [0.1, 0.05]
    torch.testing.assert_close(t.model.W, ref.W, rtol=1e-12, atol=1e-14)
    with pytest.raises(ConfigError, match="optimizer='lion': choose adamw or sgd"):
        TrainConfig(optimizer="lion")


def test_the_constructor_stores_and_setup_builds(tmp_path):
    """Trainer(...) builds and writes nothing; setup() builds the model and optimiser and
    starts the run folder, once; fit() sets up when it was not."""
    tc = TrainConfig(**TC)
    t = Trainer(TinyLM, tc, FixedBatches(4), loss_fn, run=RunFolder.open(tmp_path / "r", {"train": tc.to_dict()}))
    assert not (tmp_path / "r").exists()
    with pytest.raises(AttributeError, match="once setup"):
        _ = t.model
    assert t.setup() is t and (tmp_path / "r" / "config.json").exists()
    model, opt = t.model, t.optimizer
    assert t.setup().model is model and t.optimizer is opt
    t.fit()
    assert t.model is model and t.step == 3


def test_ignored_targets_weigh_per_token_across_micro_batches(tmp_path):
    """With --loss-ignore-id the loss is the mean over the global batch's counted targets,
    however the batch is split: batch 4 = 2 micro-batches of 2 (was 1.5 % apart by step 6:
    a mean of the micro-batches' means). A micro-batch whose targets are all ignored adds
    no cross-entropy (its mean was 0 / 0: the step stopped as "diverged")."""
    from phaseloop.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat, a dog lay in the fog; " * 400)
    common = ["train", "--preset", "rope-tiny", "--data", str(text), "--steps", "6", "--eval-every", "3",
              "--eval-windows", "2", "--log-every", "1", "--warmup", "2", "--quiet", "--seq-len", "8",
              "--loss-ignore-id", "32", "--compile", "off"]
    assert main([*common, "--batch-size", "4", "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--batch-size", "2", "--grad-accum", "2", "--out", str(tmp_path / "two")]) == 0
    _same_training(tmp_path / "one", tmp_path / "two")
    # one target a window (seq_len 1), " " every other byte: some micro-batches (and whole batches) count
    # none; one batch of 2 and 2 micro-batches of 1 train alike (the first stopped as "diverged", and after
    # the weighting the second finished where the first still did)
    text.write_text("a " * 2000)
    one = [*common[:-6], "--loss-ignore-id", "32", "--compile", "off", "--seq-len", "1", "--steps", "8"]
    assert main([*one, "--batch-size", "2", "--out", str(tmp_path / "b2")]) == 0
    assert main([*one, "--batch-size", "1", "--grad-accum", "2", "--out", str(tmp_path / "a2")]) == 0
    _same_training(tmp_path / "b2", tmp_path / "a2")


def _same_training(run_a, run_b, rtol=1e-5):
    """Two runs' losses, gradient norms and validation losses: finite and equal to ``rtol``."""
    rec = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (run_a, run_b)]
    assert len(rec[0]) == len(rec[1])
    for a, b in zip(*rec):
        for k in ("loss", "grad_norm", "val_loss"):
            if k in a:
                assert math.isfinite(a[k]) and abs(a[k] - b[k]) <= rtol * max(abs(a[k]), 1e-12), (k, a, b)


def test_an_evaluation_between_logged_steps_has_its_training_time(tmp_path):
    """elapsed_s grew only at logged steps: an evaluation (or checkpoint) between them
    recorded the time of the last log (0 before the first one), so compare's wall-clock
    speedup read a variant that reached the target as "not reached"."""
    from phaseloop.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat, a dog lay in the fog; " * 400)
    assert main(["train", "--preset", "rope-tiny", "--data", str(text), "--steps", "4", "--eval-every", "1",
                 "--eval-windows", "2", "--log-every", "4", "--ckpt-every", "2", "--quiet", "--seq-len", "8",
                 "--batch-size", "2", "--compile", "off", "--out", str(tmp_path / "r")]) == 0
    recs = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["elapsed_s"] for r in recs if "val_loss" in r]
    train = [r["elapsed_s"] for r in recs if "loss" in r]
    assert len(evals) == 4 and 0 < evals[0] < evals[1] < evals[2] <= train[-1] == evals[3]


def test_a_resumed_optimizer_keeps_this_runs_implementation():
    """A checkpoint records its param groups' fused / foreach flags; a run resumed on
    another device (CPU's foreach state into CUDA's fused AdamW) keeps its own, and the
    state itself loads unchanged (fused AdamW runs on CPU too, so both sides are real)."""
    from phaseloop.engine import dist

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    first = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model(torch.randn(5, 4)).square().sum().backward()
    first.step()
    saved = first.state_dict()
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    dist.load_optimizer(model, fused, saved, "ddp")
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]
    for p in model.parameters():
        assert torch.equal(fused.state[p]["exp_avg"], first.state[p]["exp_avg"])
        assert float(fused.state[p]["step"]) == 1.0
    fused.step()  # fused AdamW takes the loaded state
    back = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    dist.load_optimizer(model, back, fused.state_dict(), "ddp")
    assert back.param_groups[0]["foreach"] is True and not back.param_groups[0]["fused"]


def test_the_compile_fallback_rewinds_the_cuda_random_state(monkeypatch):
    """A failed first compiled step is re-run from the random state before it, the CUDA
    generator's too (dropout draws there on CUDA), checked with the CUDA calls stood in for."""
    tc = TrainConfig(steps=1, batch_size=2, warmup_steps=1, log_every=1, eval_every=10, compile="off")

    class Batches:
        def state(self):
            return {}

        def set_state(self, s):
            pass

    t = Trainer(lambda: nn.Linear(2, 2), tc, Batches(), lambda m, b, d: None)
    t.tokens, t.flops, t.optimizer = 0, type("F", (), {"total": None})(), torch.optim.SGD([nn.Parameter(torch.ones(1))])
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or "cuda-state")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", state, device)))
    t.device = torch.device("cuda", 0)
    t._rewind(t._snapshot())
    assert calls == [("get", t.device), ("set", "cuda-state", t.device)]
    calls.clear()
    t.device = torch.device("cpu")
    t._rewind(t._snapshot())
    assert calls == []


def test_weighted_micro_batches_divide_the_auxiliary_losses_by_grad_accum():
    """With --loss-ignore-id each micro-batch's cross-entropy is weighted by its share of
    the step's counted targets, and its auxiliary losses (ACT's ponder cost) by
    1 / grad_accum, as without it: the step's ponder gradient is their mean."""
    from phaseloop.engine.weighting import step_loss

    ce, aux = torch.tensor(2.0, requires_grad=True), torch.tensor(0.3, requires_grad=True)
    out = ModelOutput(logits=torch.zeros(1, 1, 1), ce_loss=ce, aux_losses={"ponder_loss": aux})
    out.loss = ce + aux
    for weight in (None, 0.25):
        scaled, logged = step_loss(out, weight, 4)
        want = (2.0 / 4 if weight is None else 2.0 * 0.25) + 0.3 / 4
        assert float(scaled) == pytest.approx(want) and float(logged) == pytest.approx(want - 0.3 / 4)
        ce.grad = aux.grad = None
        scaled.backward()
        assert float(aux.grad) == pytest.approx(0.25)
