"""Compilation from outside the model (issue 30, engine/compiling.py): block mode compiles
each trunk's targets once and equals eager; auto decides from measured step times and
keeps its choice on resume; a failed first compiled step falls back to eager.

Most tests capture the graphs with the aot_eager backend (dynamo + AOTAutograd, no code
generation: the same graphs and autograd as inductor, in a fraction of the time, and
equal to eager exactly); one test per trunk family runs inductor itself within float
tolerance."""

from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import tiny_model_config
from phaseloop.engine import TrainConfig, Trainer, compiling
from phaseloop.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TRUNKS = [("rope", {}), ("three_phase", {}), ("universal", {}), ("universal", {"act": True}),
          ("looped", {}), ("hyperloop", {}), ("mhc", {})]


tiny = tiny_model_config


def loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x, x)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("arch,over", TRUNKS, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "base")
def test_block_mode_equals_eager_for_every_trunk(arch, over, monkeypatch):
    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = build_model(tiny(arch, **over)).double()
    x = torch.randint(0, 48, (2, 12))
    want_loss, want_grads = loss_and_grads(model, x)
    undo = compiling.compile_blocks(model)
    got_loss, got_grads = loss_and_grads(model, x)
    assert counters["stats"]["unique_graphs"] >= 1  # the targets really ran compiled
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-10, atol=1e-12, msg=n)
    undo()
    assert not any("forward" in m.__dict__ for m, _ in compiling.targets(model))


@pytest.mark.parametrize("arch,over", [("rope", {}), ("universal", {"act": True}), ("hyperloop", {})],
                         ids=["rope", "universal-act", "hyperloop"])
def test_block_mode_with_inductor_within_float_tolerance(arch, over):
    torch.manual_seed(0)
    model = build_model(tiny(arch, **over))
    x = torch.randint(0, 48, (2, 12))
    want_loss, want_grads = loss_and_grads(model, x)
    compiling.compile_blocks(model)
    got_loss, got_grads = loss_and_grads(model, x)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_one_graph_serves_every_layer_and_pass(monkeypatch):
    """4 layers of a stack, and 6 passes of the UT's block, each compile one graph."""
    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    for cfg in (tiny("rope", n_layers=4), tiny("universal", n_steps=6)):
        torch._dynamo.reset()
        counters.clear()
        model = build_model(cfg)
        compiling.compile_blocks(model)
        x = torch.randint(0, 48, (2, 12))
        loss_and_grads(model, x)
        loss_and_grads(model, x)
        assert counters["stats"]["unique_graphs"] == 1, (cfg.arch, dict(counters["stats"]))


def test_decoding_with_a_cache_runs_eager(monkeypatch):
    """A KV cache's slots are Python values: cached calls take the eager method (no compile)."""
    from phaseloop.decoding import decode

    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    model = build_model(tiny("looped")).eval()
    x = torch.randint(0, 48, (1, 5))
    def step(inp, cache):
        return model(inp, cache=cache)

    want = decode(step, x, 6, temperature=0)
    compiling.compile_blocks(model)
    got = decode(step, x, 6, temperature=0)
    assert torch.equal(got, want)
    assert counters["stats"].get("unique_graphs", 0) == 0


def test_evaluation_without_grad_runs_eager(monkeypatch):
    """Block mode compiles training steps only: a no-grad evaluation takes the eager method
    (its graph would cost a compile for a few forward passes), and computes the same."""
    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    model = build_model(tiny("rope")).eval()
    x = torch.randint(0, 48, (2, 12))
    with torch.no_grad():
        want = model(x).logits
        compiling.compile_blocks(model)
        got = model(x).logits
    assert torch.equal(got, want)
    assert counters["stats"].get("unique_graphs", 0) == 0
    model(x).logits.sum().backward()  # a gradient-taking call compiles
    assert counters["stats"]["unique_graphs"] == 1


def test_decide_compares_the_saving_with_the_compile_time():
    cpu = torch.device("cpu")
    mode, line = compiling.decide(0.1, 10_000, cpu, None)  # saves 0.05 * 0.1 * 10000 = 50 s > 15 s
    assert mode == "block" and "cold estimate" in line and "10000 steps" in line
    assert compiling.decide(0.1, 1000, cpu, None)[0] == "off"  # 5 s < 15 s
    mode, line = compiling.decide(0.1, 1000, cpu, 1.5)  # a warm cache: 5 s > 1.5 s
    assert mode == "block" and "warm cache" in line


def test_legacy_boolean_compile_reads_as_a_mode():
    assert TrainConfig.from_dict({"compile": True}).compile == "model"
    assert TrainConfig.from_dict({"compile": False}).compile == "off"
    with pytest.raises(Exception, match="compile='fast'"):
        TrainConfig.from_dict({"compile": "fast"})


class Batches:
    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)

    def next(self):
        x = torch.randint(0, 48, (2, 13), generator=self.g)
        return x[:, :-1], x[:, 1:]

    def state(self):
        return {"generator": self.g.get_state()}

    def set_state(self, state):
        self.g.set_state(state["generator"])


def tconf(mode: str, steps: int = 6) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=2, warmup_steps=1, log_every=1, eval_every=1000,
                       ckpt_every=3, compile=mode)


def train(mode: str, steps: int = 6, run=None):
    tc = tconf(mode, steps)
    torch.manual_seed(0)
    t = Trainer(lambda: build_model(tiny("rope")), tc, Batches(), lambda m, b, d: m(*b), run=run)
    t.fit()
    return t


def test_a_failed_first_compiled_step_falls_back_to_eager(monkeypatch, capsys):
    def broken(fn, **kw):
        def fail(*a, **k):
            raise RuntimeError("no C++ compiler here")
        return fail

    want = [r["loss"] for r in train("off").records]
    monkeypatch.setattr(torch, "compile", broken)
    t = train("block")
    assert [r["loss"] for r in t.records] == want  # the same batches, the same numbers
    err = capsys.readouterr().err
    assert "compile block: the first compiled step failed (RuntimeError: no C++ compiler here); continuing eager" in err
    assert t.compiler.mode == "off"


def test_auto_probes_then_decides_and_a_resumed_run_keeps_the_choice(tmp_path, monkeypatch, capsys):
    from phaseloop.engine import RunFolder

    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(compiling, "COLD_S", {"cpu": 0.0, "cuda": 0.0})  # any saving pays
    cfg = {"train": tconf("auto", 8).to_dict()}
    t = train("auto", steps=8, run=RunFolder.open(tmp_path / "full", cfg))
    assert capsys.readouterr().err == ""  # a quiet run (progress off) keeps the line in its summary
    assert t.compiler.mode == "block" and t.summary()["compile"] == "block"
    assert t.summary()["compile_note"].startswith("compile auto: block (expected saving")
    assert counters["stats"]["unique_graphs"] >= 1
    eager = train("off", steps=8)
    for a, b in zip(t.records, eager.records):  # aot_eager: the same numbers as eager
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    records = json.loads((compiling.cache_root() / "records.json").read_text())
    assert len(records) == 1 and all(v >= 0 for v in records.values())
    # stopped after step 6 (checkpoint at 6), resumed where compiling would no longer pay:
    # the checkpoint's recorded choice (block) holds, so the resumed run computes as before
    monkeypatch.setattr(compiling, "recorded_seconds", lambda key: 0.0)  # compiling pays
    part = Trainer(lambda: build_model(tiny("rope")), t.tc, Batches(), lambda m, b, d: m(*b),
                   run=RunFolder.open(tmp_path / "part", cfg))
    torch.manual_seed(0)
    part.fit(stop_after=6)
    monkeypatch.setattr(compiling, "COLD_S", {"cpu": 1e9, "cuda": 1e9})
    monkeypatch.setattr(compiling, "recorded_seconds", lambda key: None)
    again = Trainer(lambda: build_model(tiny("rope")), t.tc, Batches(), lambda m, b, d: m(*b),
                    run=RunFolder.open(tmp_path / "part", cfg, resume=True))
    again.fit()
    assert again.compiler.mode == "block", capsys.readouterr().err
    assert [r["loss"] for r in again.records if "loss" in r] == [r["loss"] for r in t.records][6:]


@pytest.mark.parametrize("preset,how", [("rope-tiny", "ddp"), ("hyperloop-tiny", "fsdp")])
def test_block_mode_under_torchrun_equals_one_eager_process(tmp_path, text_file, preset, how, monkeypatch):
    """Blocks compiled before DDP / FSDP2 wrap the model (torchtitan's order), 2 processes
    = 1 eager process at the same global batch (aot_eager: the compiled graphs, fast)."""
    from test_distributed import _assert_close, _records, _run

    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    one, two = tmp_path / "one", tmp_path / "two"
    _run(one, text_file, 4, "--preset", preset, "--compile", "off")
    _run(two, text_file, 2, "--preset", preset, "--parallel", how, "--compile", "block", nproc=2)
    _assert_close(_records(one), _records(two))
    assert json.loads((two / "config.json").read_text())["train"]["compile"] == "block"


def test_train_says_what_auto_chose(tmp_path, text_file, capsys):
    """Without --quiet, one line on stderr says auto's choice and why; summary.json keeps it."""
    from conftest import TINY, run_cli

    flags = [a for a in TINY if a != "--quiet"]
    code, err = run_cli(["train", *flags, "--steps", "6", "--data", str(text_file), "--out", str(tmp_path / "r")],
                        capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("compile auto:"))
    assert line.startswith("compile auto: off (expected saving") and "over 2 steps" in line, line
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["compile_note"] == line
