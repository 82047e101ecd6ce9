"""Training for depth (issue 25): ``TrainConfig.depth_sample = "LO:HI"`` runs each training
step at a depth drawn uniformly from LO..HI as a function of (seed, step); evaluation,
checkpoints and decoding see the trained depth; bad ranges are one-line errors."""

import json
import random

import pytest
import torch
from conftest import TINY, assert_one_line, run_cli

from phaseloop.compare.recipe import Recipe, RecipeError
from phaseloop.compare.runner import run_comparison
from phaseloop.config import ModelConfig
from phaseloop.depth import parse_depth_range, sample_depth
from phaseloop.engine import RunFolder, TrainConfig, Trainer, read_metrics
from phaseloop.errors import ConfigError
from phaseloop.lm.train import lm_loss
from phaseloop.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, vocab_size=16, max_seq_len=8)


def tiny(preset: str, **kw) -> ModelConfig:
    return ModelConfig.from_preset(preset, **SMALL, **kw)


class Tokens:
    """Seeded (inputs, targets) batches with the engine's state protocol."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def next(self):
        x = torch.randint(0, 16, (2, 8), generator=self.g)
        return x, torch.roll(x, -1, 1)

    def state(self):
        return {"generator": self.g.get_state()}

    def set_state(self, state):
        self.g.set_state(state["generator"])


class Counted:
    """Build ``cfg``'s model with a hook counting applications of ``block(model)``; the
    loss function and the evaluation record the count of each forward."""

    def __init__(self, cfg: ModelConfig, block=lambda m: m.trunk.block):
        self.cfg, self.block, self.calls, self.model = cfg, block, 0, None
        self.train_counts, self.eval_counts, self.limits = [], [], []

    def build(self):
        model = build_model(self.cfg)
        if next(model.parameters()).device.type != "meta":
            self.model = model
            self.block(model).register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return model

    def loss(self, model, batch, device):
        self.calls = 0
        out = lm_loss(model, batch, device)
        self.train_counts.append(self.calls)
        self.limits.append(getattr(self.model.trunk, "steps", None))  # UT: the step (ACT: limit) set
        return out

    def evaluate(self, model):
        self.calls = 0
        with torch.no_grad():
            model(*Tokens(1).next())
        self.eval_counts.append(self.calls)
        return {"val_loss": 0.0}


TC = dict(batch_size=2, lr=1e-3, warmup_steps=1, log_every=1, device="cpu")


def test_sampled_depths_follow_the_seed_and_cover_the_range():
    seq = [sample_depth((2, 6), 0, s) for s in range(300)]
    random.seed(7), torch.manual_seed(7)  # no global RNG state enters (each rank, a resumed run)
    assert seq == [sample_depth((2, 6), 0, s) for s in range(300)]  # same seed: same sequence
    assert seq[120:] == [sample_depth((2, 6), 0, s) for s in range(120, 300)]  # from any step on
    assert seq != [sample_depth((2, 6), 1, s) for s in range(300)]
    assert set(seq) == {2, 3, 4, 5, 6}  # every depth of the range, none outside it
    assert all(abs(seq.count(d) / 300 - 0.2) < 0.08 for d in range(2, 7))  # ~uniform
    assert {sample_depth((3, 3), 0, s) for s in range(20)} == {3}
    assert parse_depth_range("2:6") == (2, 6) and parse_depth_range("5") == (5, 5)


@pytest.mark.parametrize("bad", ["0:3", "4:2", "2-6", "a:b", "1:2:3", "", "2:99999"])
def test_bad_ranges_are_one_line_config_errors(bad):
    with pytest.raises(ConfigError, match="depth_sample=") as e:
        TrainConfig(depth_sample=bad)
    assert "\n" not in str(e.value) and "LO:HI" in str(e.value)


def test_extend_loops_needs_depth_sample():
    with pytest.raises(ConfigError, match="applies with depth_sample"):
        TrainConfig(extend_loops="last")
    with pytest.raises(ConfigError, match="choose last"):
        TrainConfig(depth_sample="1:3", extend_loops="first")


def test_each_step_runs_at_its_sampled_depth_and_evaluates_at_the_trained():
    """UT (trained 4 steps) with depth_sample 1:6 and two micro-batches a step: the shared
    block runs sample_depth(seed, step) times in both micro-batches of every step, 4 times
    in every evaluation, and the model is left at 4 steps."""
    c = Counted(tiny("universal-tiny"))
    tc = TrainConfig(**TC, steps=8, grad_accum=2, eval_every=4, seed=3, depth_sample="1:6")
    t = Trainer(c.build, tc, Tokens(), c.loss, evaluate=c.evaluate)
    t.fit()
    want = [sample_depth((1, 6), 3, s) for s in range(8)]
    assert len(set(want)) > 1  # the check below could not pass by running one depth
    assert c.train_counts == [d for d in want for _ in range(2)]
    assert c.eval_counts == [4, 4]
    assert t.model.trunk.steps == 4


def test_without_depth_sample_every_step_runs_the_trained_depth():
    c = Counted(tiny("universal-tiny"))
    Trainer(c.build, TrainConfig(**TC, steps=3), Tokens(), c.loss).fit()
    assert c.train_counts == [4, 4, 4]


def test_act_samples_the_step_limit():
    c = Counted(tiny("universal-act-tiny"))
    tc = TrainConfig(**TC, steps=6, depth_sample="2:5")
    t = Trainer(c.build, tc, Tokens(), c.loss)
    t.fit()
    want = [sample_depth((2, 5), 0, s) for s in range(6)]
    assert c.limits == want  # the step limit set for the forward
    assert all(1 <= n <= d for n, d in zip(c.train_counts, want))  # ACT may halt everywhere earlier
    assert t.model.trunk.steps == t.model.trunk.trained_steps


def test_hyperloop_beyond_its_loops_needs_extend_last():
    cfg = tiny("hyperloop-tiny")  # 2 trained loops, one middle layer
    with pytest.raises(ConfigError, match="extend='last'"):
        Trainer(lambda: build_model(cfg), TrainConfig(**TC, steps=1, depth_sample="1:3"), Tokens(), lm_loss).setup()
    c = Counted(cfg, block=lambda m: m.trunk.middle[0])
    t = Trainer(c.build, TrainConfig(**TC, steps=6, depth_sample="1:3", extend_loops="last"), Tokens(), c.loss)
    t.fit()
    assert c.train_counts == [sample_depth((1, 3), 0, s) for s in range(6)]
    assert t.model.trunk.loops == 2


def test_a_stack_is_refused():
    with pytest.raises(ConfigError, match="no depth to change"):
        Trainer(lambda: build_model(tiny("rope-tiny")), TrainConfig(**TC, steps=1, depth_sample="2:3"),
                Tokens(), lm_loss).setup()


def test_resume_continues_the_depth_sequence_exactly(tmp_path):
    """Stopped after 3 steps (checkpoint at 2) and resumed = uninterrupted: the same depth
    per step, the same records, the same weights."""
    tc = TrainConfig(**TC, steps=6, ckpt_every=2, depth_sample="1:6", seed=1)
    cfg = {"train": tc.to_dict()}
    full = Counted(tiny("universal-tiny"))
    a = Trainer(full.build, tc, Tokens(), full.loss, run=RunFolder.open(tmp_path / "full", cfg))
    a.fit()
    part = Counted(tiny("universal-tiny"))
    Trainer(part.build, tc, Tokens(), part.loss, run=RunFolder.open(tmp_path / "part", cfg)).fit(stop_after=3)
    again = Counted(tiny("universal-tiny"))
    b = Trainer(again.build, tc, Tokens(), again.loss, run=RunFolder.open(tmp_path / "part", cfg, resume=True))
    b.fit()
    assert part.train_counts[:2] + again.train_counts == full.train_counts
    assert full.train_counts == [sample_depth((1, 6), 1, s) for s in range(6)]
    keys = ("step", "loss", "lr", "grad_norm")
    assert [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "part")] == \
        [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "full")]
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- commands
def test_train_records_depth_sample_and_resume_checks_it(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    args = ["train", *TINY, "--preset", "universal-tiny", "--steps", "2", "--eval-every", "2",
            "--data", text_file, "--out", run]
    assert run_cli([*args, "--depth-sample", "2:5"], capsys)[0] == 0
    assert json.loads((run / "config.json").read_text())["train"]["depth_sample"] == "2:5"
    code, err = run_cli([*args, "--depth-sample", "2:6", "--steps", "3", "--resume"], capsys)
    assert_one_line(code, err, "depth_sample: '2:5' there, '2:6' now")


@pytest.mark.parametrize("preset,extra,pattern", [
    ("universal-tiny", ["--depth-sample", "0:3"], "out of range"),
    ("universal-tiny", ["--depth-sample", "3:x"], "write LO:HI"),
    ("universal-tiny", ["--extend-loops", "last"], "applies with depth_sample"),
    ("rope-tiny", ["--depth-sample", "2:3"], "no depth to change"),
    ("hyperloop-tiny", ["--depth-sample", "1:3"], "extend='last'"),
])
def test_train_bad_depth_sample_is_one_line_and_writes_nothing(tmp_path, text_file, capsys, preset, extra, pattern):
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--preset", preset, "--steps", "2", "--data", text_file,
                         "--out", run, *extra], capsys)
    assert_one_line(code, err, pattern)
    assert not (run / "config.json").exists() and not (run / "checkpoint").exists()


def _recipe(text_file, variants):
    return Recipe.from_dict(dict(name="d", data=str(text_file), scale="tiny", seeds=[0], variants=variants,
                                 train=dict(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_every=2,
                                            eval_windows=2, ckpt_every=2, log_every=1, depth_sample="2:3")))


def test_compare_recipes_train_for_depth(tmp_path, text_file):
    run_comparison(_recipe(text_file, ["universal", "looped"]), tmp_path / "c", progress=False, log=None)
    configs = sorted((tmp_path / "c" / "runs").glob("*/config.json"))
    assert len(configs) == 2 and all(json.loads(c.read_text())["train"]["depth_sample"] == "2:3" for c in configs)


def test_compare_refuses_a_stack_variant_before_training(tmp_path, text_file):
    with pytest.raises(RecipeError, match="variant 'rope'.*no depth to change"):
        run_comparison(_recipe(text_file, ["universal", "rope"]), tmp_path / "c", progress=False, log=None)
    assert not (tmp_path / "c" / "runs").exists()


def test_a_plugin_trunk_without_reset_depth_is_refused():
    """A weight-tied plugin trunk must say how to return to its trained depth; without
    reset_depth the engine would leave it at the last sampled depth."""
    from phaseloop.depth import check_depth_sample
    from phaseloop.trunk import Trunk

    class Loop(Trunk):
        dynamic_depth = True

        def set_depth(self, n, extend=None):
            self.n = n

    with pytest.raises(ConfigError, match="defines no reset_depth"):
        check_depth_sample(Loop(), (1, 2))

    class Resettable(Loop):
        def reset_depth(self):
            self.n = 3

    t = Resettable()
    check_depth_sample(t, (1, 2))
    assert t.n == 3


def test_an_encoder_decoder_returns_each_side_to_its_own_trained_steps():
    """UniversalSeq2Seq with ACT on the decoder only: its sides train at different step
    limits (n_steps, act_steps); after a sampled step each is back at its own."""
    from phaseloop.archs.universal import UniversalSeq2Seq
    from phaseloop.depth import sampled_depth

    cfg = tiny("universal-act-tiny")
    m = UniversalSeq2Seq(cfg, encoder_act=False, decoder_act=True)
    enc, dec = m.encoder.steps, m.decoder.steps
    assert (enc, dec) == (cfg.n_steps, cfg.act_steps) and enc != dec
    with sampled_depth(m, TrainConfig(depth_sample="1:2"), 0) as d:
        assert m.encoder.steps == m.decoder.steps == d
    assert (m.encoder.steps, m.decoder.steps) == (enc, dec)


def test_mfu_counts_each_step_at_its_sampled_depth(tmp_path, text_file):
    """Issue 38, item 9: MFU = 3 x forward FLOPs x tokens/s / peak, the FLOPs per token
    those of the depth each step ran at (``analysis.params.flops_per_token``, counted), in
    every record (one step each) and over the run in the summary, also across a resume."""
    from phaseloop.analysis.params import flops_per_token
    from phaseloop.lm.train import train

    cfg = ModelConfig.from_preset("universal-tiny")  # trained at n_steps, sampled at 1..3
    assert cfg.n_steps not in (1, 2, 3)
    tc = TrainConfig(steps=4, batch_size=2, seq_len=16, warmup_steps=1, eval_every=4, eval_windows=1,
                     log_every=1, ckpt_every=2, depth_sample="1:3", seed=3, peak_tflops=1e-6, device="cpu")
    flops = {d: flops_per_token(cfg, 16, d) for d in (1, 2, 3)}
    assert len(set(flops.values())) == 3
    train(cfg, tc, text_file, tmp_path / "run", progress=False, stop_after=2)
    summary = train(cfg, tc, text_file, tmp_path / "run", resume=True, progress=False)
    peak = 1e-6 * 1e12
    depths = [sample_depth((1, 3), 3, s) for s in range(4)]
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r, d in zip(steps, depths):
        assert r["mfu"] == pytest.approx(3 * flops[d] * r["tok_per_s"] / peak, rel=1e-9), (r, d)
    mean = sum(flops[d] for d in depths) / 4  # every step trains the same number of tokens
    assert summary["mfu"] == pytest.approx(3 * mean * summary["tok_per_s"] / peak, rel=1e-9)
