"""Compilation from outside the model (issue 30, engine/compiling.py): block mode compiles
each trunk's targets once and equals eager; auto decides from measured step times and
keeps its choice on resume; a failed first compiled step falls back to eager.

Most tests capture the graphs with the aot_eager backend (dynamo + AOTAutograd, no code
generation: the same graphs and autograd as inductor, in a fraction of the time, and
equal to eager exactly); one test per trunk family runs inductor itself within float
tolerance."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys

import pytest
import torch
from conftest import tiny_model_config
from torch._dynamo.utils import counters

from phaseloop.engine import TrainConfig, Trainer, compile_cache, compiling
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


@pytest.mark.parametrize("arch,over", [("rope", {}), ("three_phase", {}), ("universal", {"act": True}),
                                       ("hyperloop", {})], ids=["rope", "three_phase", "universal-act", "hyperloop"])
def test_block_mode_with_inductor_within_float_tolerance(arch, over):
    import warnings

    torch.manual_seed(0)
    model = build_model(tiny(arch, **over))
    x = torch.randint(0, 48, (2, 12))
    want_loss, want_grads = loss_and_grads(model, x)
    compiling.compile_blocks(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got_loss, got_grads = loss_and_grads(model, x)
    # 3PT's rotation runs in reals when compiled: inductor has no complex kernels (it warns)
    assert not [w for w in seen if "complex" in str(w.message)], [str(w.message) for w in seen]
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


def test_decide_compares_the_saving_with_the_compile_time(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(compiling, "SAVING", {"cpu": 0.05, "cuda": 0.25})
    monkeypatch.setattr(compiling, "COLD_S", {"cpu": 15.0, "cuda": 60.0})
    monkeypatch.setattr(compiling, "LOAD_S", {"cpu": 2.0, "cuda": 5.0})
    mode, line = compiling.decide(0.1, 10_000, cpu)  # saves 0.05 * 0.1 * 10000 = 50 s > 15 s
    assert mode == "block" and "cold estimate" in line and "10000 steps" in line and "(estimated)" in line
    assert compiling.decide(0.1, 1000, cpu)[0] == "off"  # 5 s < 15 s
    # a warm cache: the recorded load (1.5 s), not the cold compile (40 s), is the cost
    mode, line = compiling.decide(0.1, 1000, cpu, {"compile_s": 40.0, "load_s": 1.5})
    assert mode == "block" and "warm cache" in line and "1.5 s to compile" in line
    # compiled before, no load measured yet: the load estimate (2 s < 5 s)
    assert compiling.decide(0.1, 1000, cpu, {"compile_s": 40.0})[0] == "block"
    # the saving measured here replaces the estimate: 1 % of 100 s = 1 s < 1.5 s
    mode, line = compiling.decide(0.1, 1000, cpu, {"load_s": 1.5, "saving": 0.01})
    assert mode == "off" and "at 1.0% (measured)" in line
    # never compiled here, shared by 4 runs: 4 x 5 s = 20 s > 15 + 3 x 2 = 21 s? no; 5 runs: 25 > 23
    assert compiling.decide(0.1, 1000, cpu, share=4)[0] == "off"
    mode, line = compiling.decide(0.1, 1000, cpu, share=5)
    assert mode == "block" and "x 5 runs" in line and "23.0 s to compile" in line and "4 warm loads" in line
    # compiled by an earlier run of this process (compare's sequential runs): free
    mode, line = compiling.decide(0.1, 1000, cpu, {"compile_s": 40.0, "saving": 0.001}, here=True)
    assert mode == "block" and "0.0 s to compile, compiled by an earlier run in this process" in line


def test_records_keep_what_runs_measured_and_read_old_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path))
    assert compile_cache.read_record("k") == {}
    compile_cache.update_record("k", compile_s=12.0)
    compile_cache.update_record("k", load_s=1.25, saving=0.125)
    assert compile_cache.read_record("k") == {"compile_s": 12.0, "load_s": 1.25, "saving": 0.125, "savings": [0.125]}
    for x in (0.03, 0.09, 0.01, 0.2, 0.1, 0.11, 0.12, 0.13):  # the median of the last 8 runs' savings
        compile_cache.update_record("k", saving=x)
    rec = compile_cache.read_record("k")
    assert rec["savings"] == [0.03, 0.09, 0.01, 0.2, 0.1, 0.11, 0.12, 0.13] and rec["saving"] == 0.11
    assert rec["compile_s"] == 12.0 and rec["load_s"] == 1.25
    path = compile_cache.cache_root() / "records.json"
    path.write_text(json.dumps({"old": 14.5, "bad": {"savings": "x", "load_s": True}, "nan": {"savings": [None]}}))
    assert compile_cache.read_record("old") == {"compile_s": 14.5}  # a record written before savings were kept
    assert compile_cache.read_record("bad") == {} and compile_cache.read_record("nan") == {}
    path.write_text("{not json")
    assert compile_cache.read_record("k") == {}  # only an estimate's input: unreadable means none


def test_runs_that_compile_the_same_blocks_share_one_compile():
    """rope and rope in another init regime compile the same blocks; 3PT and another batch do not."""
    tc, other = TrainConfig(batch_size=2, seq_len=12), TrainConfig(batch_size=4, seq_len=12)
    rope, rope_torch, tpt = tiny("rope"), tiny("rope", init="torch", embed_init_std=1.0), tiny("three_phase")
    runs = [("a", lambda: build_model(rope), tc), ("b", lambda: build_model(rope_torch), tc),
            ("c", lambda: build_model(tpt), tc), ("d", lambda: build_model(rope), other)]
    assert compiling.shares(runs) == {"a": 2, "b": 1, "c": 1, "d": 1}  # from each run on


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
    monkeypatch.setattr(compiling, "SAVING", {"cpu": 0.5, "cuda": 0.5})
    monkeypatch.setattr(compiling, "MEASURE", 1)
    cfg = {"train": tconf("auto", 8).to_dict()}
    t = train("auto", steps=8, run=RunFolder.open(tmp_path / "full", cfg))
    assert capsys.readouterr().err == ""  # a quiet run (progress off) keeps the line in its summary
    assert t.compiler.mode == "block" and t.summary()["compile"] == "block"
    assert t.summary()["compile_note"].startswith("compile auto: block (expected saving")
    assert counters["stats"]["unique_graphs"] >= 1
    # a second run in this process reuses dynamo's graphs: no compile, nothing recorded
    before = json.loads((compile_cache.cache_root() / "records.json").read_text())
    second = train("auto", steps=8)
    assert "compiled by an earlier run in this process" in second.summary()["compile_note"]
    after = json.loads((compile_cache.cache_root() / "records.json").read_text())
    assert {k: v.get("compile_s") for k, v in after.items() if isinstance(v, dict)} == \
        {k: v.get("compile_s") for k, v in before.items() if isinstance(v, dict)}
    eager = train("off", steps=8)
    for a, b in zip(t.records, eager.records):  # aot_eager: the same numbers as eager
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    records = json.loads((compile_cache.cache_root() / "records.json").read_text())
    rec = records[compiling.shape_key(t.model, compiling.batch_key(t.tc), torch.device("cpu"), "block")]
    # the first compiled step's seconds, then the saving measured
    assert set(rec) == {"compile_s", "savings"} and rec["compile_s"] >= 0 and rec["savings"][0] < 1
    # stopped after step 6 (checkpoint at 6), resumed where compiling would no longer pay:
    # the checkpoint's recorded choice (block) holds, so the resumed run computes as before
    monkeypatch.setattr(compile_cache, "read_record", lambda key: {"load_s": 0.0})  # compiling pays
    part = Trainer(lambda: build_model(tiny("rope")), t.tc, Batches(), lambda m, b, d: m(*b),
                   run=RunFolder.open(tmp_path / "part", cfg))
    torch.manual_seed(0)
    part.fit(stop_after=6)
    monkeypatch.setattr(compiling, "COLD_S", {"cpu": 1e9, "cuda": 1e9})
    monkeypatch.setattr(compile_cache, "read_record", lambda key: {})
    again = Trainer(lambda: build_model(tiny("rope")), t.tc, Batches(), lambda m, b, d: m(*b),
                    run=RunFolder.open(tmp_path / "part", cfg, resume=True))
    again.fit()
    assert again.compiler.mode == "block", capsys.readouterr().err
    assert [r["loss"] for r in again.records if "loss" in r] == [r["loss"] for r in t.records][6:]


def test_a_run_resumed_while_auto_probes_decides_at_the_same_step(tmp_path, monkeypatch):
    """A checkpoint written before auto chose (step 3 of a 6-step probe) keeps the probe:
    the resumed run decides after the same step, from those times and its own (its first
    step a warm-up, not timed), and computes as the uninterrupted run does (before, it probed
    anew and switched 3 steps later). A probe of other shapes, device or world size is
    dropped; a damaged one is refused."""
    from phaseloop.engine import RunFolder
    from phaseloop.engine.checkpoint import checkpoint_dir, load_trainer_state
    from phaseloop.errors import CheckpointError

    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(compiling, "COLD_S", {"cpu": 0.0, "cuda": 0.0})  # any saving pays
    monkeypatch.setattr(compiling, "SAVING", {"cpu": 0.5, "cuda": 0.5})
    monkeypatch.setattr(compile_cache, "read_record", lambda key: {})  # not what other tests measured
    decided, original = [], compiling.RunCompiler._decide

    def spy(self, steps_left):
        decided.append((steps_left, list(self.times[:3]), list(self.warm)))
        original(self, steps_left)
    monkeypatch.setattr(compiling.RunCompiler, "_decide", spy)
    cfg = {"train": tconf("auto", 10).to_dict()}
    full = train("auto", steps=10, run=RunFolder.open(tmp_path / "full", cfg))
    part = Trainer(lambda: build_model(tiny("rope")), full.tc, Batches(), lambda m, b, d: m(*b),
                   run=RunFolder.open(tmp_path / "part", cfg))
    torch.manual_seed(0)
    part.fit(stop_after=3)
    meta, _ = load_trainer_state(checkpoint_dir(tmp_path / "part"))
    probe = meta["compile_probe"]
    assert "compile" not in meta and len(probe["times"]) == 3 and probe["warm"] == [0] and len(decided) == 1
    again = Trainer(lambda: build_model(tiny("rope")), full.tc, Batches(), lambda m, b, d: m(*b),
                    run=RunFolder.open(tmp_path / "part", cfg, resume=True))
    again.fit()
    assert decided[0][0] == decided[1][0] == 4  # after step 6 of 10, in both runs
    assert decided[1][1:] == (probe["times"], [0, 3])  # the recorded times; step 4 warmed this process up
    assert again.compiler.mode == full.compiler.mode == "block"
    assert [r["loss"] for r in again.records if "loss" in r] == [r["loss"] for r in full.records][3:]
    model, cpu = full.model, torch.device("cpu")
    same = compiling.RunCompiler("auto", model, cpu, full.compiler.key_extra, probe=probe)
    assert same.times == probe["times"] and same.warm == [0, 3]
    other = compiling.RunCompiler("auto", model, cpu, "8x64x1", probe=probe)  # another batch: probed anew
    assert other.times == [] and other.warm == [0]
    for damaged in ("fast", probe["times"], {**probe, "times": [1.0] * 9}, {**probe, "times": [-1.0]},
                    {**probe, "times": [True]}, {**probe, "warm": [5]}, {k: v for k, v in probe.items() if k != "key"}):
        with pytest.raises(CheckpointError, match="compile_probe .* is damaged"):
            compiling.RunCompiler("auto", model, cpu, "", probe=damaged)


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
    code, err = run_cli(["train", *flags, "--steps", "8", "--data", str(text_file), "--out", str(tmp_path / "r")],
                        capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("compile auto:"))
    assert line.startswith("compile auto: off (expected saving") and "over 2 steps" in line, line
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["compile_note"] == line


def test_a_comparison_tells_each_run_how_many_share_its_compile(tmp_path, monkeypatch):
    """runner.execute counts the runs it launches that compile the same blocks; the count
    travels in the run description (old descriptions without it read as 1) to lm.train."""
    from phaseloop.compare import runner
    from phaseloop.compare.launch import LaunchOptions
    from phaseloop.compare.runs import CompareRun
    from phaseloop.lm import train as lm

    seen = {}

    def fake_train(cfg, tc, data, run_dir, **kw):
        seen[run_dir.name] = kw["compile_share"]
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")
        return {}

    monkeypatch.setattr(lm, "train", fake_train)
    tc = TrainConfig(batch_size=2, seq_len=12, steps=2)
    data = {"spec": "x", "tokenizer": "bytes", "text_column": None}
    specs = [CompareRun(f"{v}-s{s}", v, s, tiny(v), dataclasses.replace(tc, seed=s), tmp_path, data)
             for v in ("rope", "three_phase") for s in (0, 1, 2)]
    runner.execute(specs, LaunchOptions(), corpus=object(), device="cpu")
    assert seen == {"rope-s0": 3, "rope-s1": 2, "rope-s2": 1, "three_phase-s0": 3, "three_phase-s1": 2,
                    "three_phase-s2": 1}
    spec = dataclasses.replace(specs[0], compile_share=5)
    assert CompareRun.load(spec.save()).compile_share == 5
    old = json.loads(spec.spec_path.read_text())
    del old["compile_share"]
    spec.spec_path.write_text(json.dumps(old))
    assert CompareRun.load(spec.spec_path).compile_share == 1
    from phaseloop.errors import CheckpointError

    for bad in (0, "3", 2.5):  # a damaged description is refused, in one line
        spec.spec_path.write_text(json.dumps({**old, "compile_share": bad}))
        with pytest.raises(CheckpointError, match="is not a run description"):
            CompareRun.load(spec.spec_path)


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="x86-64 Linux only")
def test_the_vector_isa_checks_run_once_per_machine(tmp_path, monkeypatch):
    """Inductor's per-process ISA checks (a build, then a child Python loading it) run once;
    their verdict is kept, later processes tell inductor; a failed check is never trusted.
    inductor's config is patched through its own ``patch`` (restored as found): a
    monkeypatch of ``ic.cpp`` would delete the key at teardown, and every later compile in
    this process that missed the inductor cache would then fail."""
    import torch._inductor.config as ic
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path))
    checked = []
    monkeypatch.setattr(compile_cache, "_isa_builds", lambda isa: checked.append(str(isa)) or True)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
    before = ic.cpp.vec_isa_ok
    with ic.patch({"cpp.vec_isa_ok": None}):
        compile_cache.trust_vec_isa()
        assert checked == ["avx512", "avx2"] and ic.cpp.vec_isa_ok is True  # the ISAs the CPU flags name
        ic.cpp.vec_isa_ok = None  # a new process: the kept verdict, no check
        compile_cache.trust_vec_isa()
        assert checked == ["avx512", "avx2"] and ic.cpp.vec_isa_ok is True
        ic.cpp.vec_isa_ok = None  # another CPU whose check fails
        monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2"])
        monkeypatch.setattr(compile_cache, "_isa_builds", lambda isa: False)
        compile_cache.trust_vec_isa()
        compile_cache.trust_vec_isa()
        assert ic.cpp.vec_isa_ok is None
        ic.cpp.vec_isa_ok = False  # the user's TORCHINDUCTOR_VEC_ISA_OK=0 stands
        monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
        compile_cache.trust_vec_isa()
        assert ic.cpp.vec_isa_ok is False
    assert ic.cpp.vec_isa_ok == before  # restored, not deleted (reading a deleted key raises)


def test_inductor_caches_go_into_phaseloops_folder(tmp_path, monkeypatch):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR when first asked:
    that value is replaced by phaseloop's folder; a folder the user chose is kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path))
    monkeypatch.setenv("PHASELOOP_COMPILE_BACKEND", "aot_eager")  # no ISA checks here
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert cache_dir() == os.path.abspath(default_cache_dir())  # sets the variable, as inductor does
    compile_cache.use_cache()
    want = compile_cache.cache_root() / f"torch-{torch.__version__}" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(want) and cache_dir() == str(want)
    assert str(tmp_path) in os.environ["TRITON_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compile_cache.use_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
