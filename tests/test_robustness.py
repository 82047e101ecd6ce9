"""Reliability (docs/reliability.md): bad input gets one line and exit 2 and leaves every
file of an existing run byte-identical; damage is refused by name, never taken for a
missing checkpoint; non-finite training stops (exit 3) or is skipped; strict JSON only;
no orphans after interruptions."""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import TINY, assert_one_line, run_cli, snapshot, write_corpus

from phaseloop.cli import main
from phaseloop.engine import TrainConfig, Trainer
from phaseloop.engine.checkpoint import load_run, save_checkpoint
from phaseloop.engine.trainer import DivergedError
from phaseloop.files import sha256_file as file_sha256
from phaseloop.model import ModelOutput


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished tiny run (6 steps, checkpoints every 3) and the files the cases use."""
    root = tmp_path_factory.mktemp("robust")
    text = write_corpus(root / "corpus.txt")
    run = root / "run"
    code = main(["train", *TINY, "--steps", "6", "--eval-every", "3", "--ckpt-every", "3",
                 "--data", str(text), "--out", str(run)])
    assert code == 0
    (root / "afile").write_text("x")
    (root / "loop").symlink_to(root / "loop")
    (root / "empty.txt").write_text("")
    (root / "bad.toml").write_text("variants = [\n")
    (root / "typo.toml").write_text('variants = ["rope n_layerz=3", "three_phase"]\nreference = "rope"\n')
    (root / "adir").mkdir()
    (root / "ignore.toml").write_text("[train]\nloss_ignore_id = 100000\n")
    (root / "ignore-recipe.toml").write_text('variants = ["rope-tiny"]\nseeds = [0]\n[train]\nsteps = 2\n'
                                             'loss_ignore_id = 100000\n')
    return {"root": root, "run": run, "text": text}


def fill(argv, w):
    return [str(a).format(**{k: str(v) for k, v in w.items()}) for a in argv]


# (argv, pattern): each must end with exit 2, one line, the run untouched
BAD = [
    # train
    (["train", *TINY, "--data", "{text}", "--out", "{root}/afile"], "is a file, not a folder"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/afile/run"], "lies under the file"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/loop/run"], "symlink loop"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x1", "--set", "d_model=6000000",
      "--set", "n_heads=1", "--set", "n_kv_heads=1"], "parameters; training it needs at least"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x2", "--lr", "inf"], "lr=inf"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x3", "--lr", "nan"], "lr=nan"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x4", "--grad-clip", "inf"], "grad_clip=inf"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x5", "--seq-len", "65"],
     "longer than the model's max_seq_len 64"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x6", "--steps", "-1"], "steps=-1"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x7", "--batch-size", "0"], "batch_size=0"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x8", "--val-fraction", "1.5"], "val_fraction=1.5"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x9", "--skip-nonfinite", "-2"], "skip_nonfinite=-2"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x10", "--device", "cuda:0"], "cuda"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x11", "--set", "max_seq_len=0"], "max_seq_len"),
    (["train", *TINY, "--data", "{root}/loop", "--out", "{root}/x12"], "symlink loop"),
    (["train", *TINY, "--data", "{root}/empty.txt", "--out", "{root}/x13"], "empty"),
    (["train", *TINY, "--data", "{text}", "--tokenizer", "nosuch", "--out", "{root}/x14"], "unknown tokenizer"),
    (["train", *TINY, "--data", "{text}", "--tokenizer", "{root}/loop", "--out", "{root}/x15"], "symlink loop"),
    (["train", *TINY, "--steps", "6", "--data", "{text}", "--out", "{run}"], "already holds a run"),
    (["train", *TINY, "--steps", "6", "--data", "{text}", "--out", "{run}", "--resume", "--lr", "0.5"],
     "different train config (lr: 0.001 there, 0.5 now)"),
    (["train", *TINY, "--steps", "6", "--data", "{text}", "--out", "{run}", "--resume", "--set",
      "n_layers=3"], "different model config (n_layers"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x16", "--steps", "many"], "invalid int value"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x17", "--beta2", "1.0"], "beta2=1.0: must be in [0, 1)"),
    (["train", *TINY, "--data", "{text}", "--out", "{root}/x18", "--beta1", "1"], "beta1=1.0: must be in [0, 1)"),
    (["train", *TINY, "--data", "{text}", "--resume"], "--resume needs --out"),
    (["train", "--config", "{root}/ignore.toml", *TINY, "--data", "{text}", "--out", "{root}/x19"],
     "loss_ignore_id=100000: no token has it (the vocabulary holds ids 0 .. 255)"),
    (["train", *TINY, "--data", "{text}", "--out", ""], "--out '': name a folder"),
    # eval
    (["eval", "{run}", "--windows", "0"], "--windows: 0 is out of range"),
    (["eval", "{run}", "--windows", "-3"], "--windows: -3"),
    (["eval", "{run}", "--seq-len", "1000"], "longer than the model's max_seq_len"),
    (["eval", "{run}", "--seq-len", "0"], "--seq-len: 0"),
    (["eval", "{root}/nosuch"], "does not exist"),
    (["eval", "{root}/loop"], "symlink loop"),
    (["eval", "{root}/adir"], "config.json not found"),
    (["eval", "{run}", "--data", "{root}/loop"], "symlink loop"),
    (["eval", "{run}", "--device", "cuda"], "--device 'cuda': no CUDA device here; use --device cpu"),
    # generate
    (["generate", "{run}", "--temperature", "nan"], "--temperature: nan"),
    (["generate", "{run}", "--temperature", "-1"], "--temperature -1"),
    (["generate", "{run}", "--temperature", "inf"], "--temperature: inf"),
    (["generate", "{run}", "--top-k", "0"], "--top-k"),
    (["generate", "{run}", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "{root}/nosuch"], "does not exist"),
    # compare
    (["compare", "{root}/nosuch.toml"], "not found"),
    (["compare", "{root}/bad.toml"], "not valid TOML"),
    (["compare", "{root}/adir"], "is a folder"),
    (["compare", "{root}/loop"], "symlink loop"),
    (["compare", "{root}/typo.toml"], "unknown field 'n_layerz' (did you mean 'n_layers'?)"),
    (["compare", "--variants", "rope n_layerz=3", "--out", "{root}/c1"], "did you mean 'n_layers'"),
    (["compare", "--seeds", "a,b", "--out", "{root}/c2"], "--seeds"),
    (["compare", "--steps", "0", "--out", "{root}/c3"], "--steps: 0 is out of range"),
    (["compare", "{root}/ignore-recipe.toml", "--data", "{text}", "--out", "{root}/c4"],
     "variant 'rope-tiny': loss_ignore_id=100000: no token has it (the vocabulary holds ids 0 .. 255)"),
    (["compare", "--out", "{root}/afile", "--steps", "2", "--data", "{text}", "--variants",
      "rope-tiny max_seq_len=128"], "is a file"),
    (["compare", "--out", "{root}/c5", "--steps", "2", "--data", "{text}", "--variants", "rope-tiny"],
     "variant 'rope-tiny': seq_len 128 is longer than its model's max_seq_len 64"),
    # quantize
    (["quantize", "{run}", "--bits", "8", "--out", "{root}/afile"], "is a file"),
    (["quantize", "{run}", "--bits", "8", "--group-size", "0"], "--group-size 0"),
    (["quantize", "{run}", "--bits", "8", "--windows", "0"], "--windows"),
    (["quantize", "{run}", "--bits", "3"], "invalid choice"),
    # export
    (["export", "{run}", "--out", ""], "--out '': name a new folder"),
    # task / babi
    (["task", "--task", "nope", "--out", "{root}/t1"], "nope"),
    (["task", "--task", "copy", "--train-len", "abc", "--out", "{root}/t2"], "abc"),
    (["task", "--task", "jsonl:{root}/loop", "--out", "{root}/t3"], "symlink loop"),
    (["task", "--task", "jsonl:", "--out", "{root}/t5"], "empty path"),
    (["task", "--task", "jsonl:{text}", "--train-len", "3", "--out", "{root}/t6"], "--train-len: --train-len/"),
    (["task", "--task", "copy", "--out", "{root}/afile"], "afile"),
    (["babi", "--data-dir", "{root}/adir", "--out", "{root}/t4"], "bAbI"),
    (["task", "--task", "copy", "--seeds", "0,1,0", "--out", "{root}/t7"], "seed 0 is repeated"),
    (["babi", "--seeds", "3,3", "--out", "{root}/t8"], "seed 3 is repeated"),
    # tokenizer
    (["tokenizer", "train", "--data", "{text}", "--vocab-size", "10", "--out", "{root}/k1"], "use >= 256 (or"),
    (["demo", "parity", "--length", "5000"], "must be an integer from 1 to 4,096"),
    (["demo", "parity", "--layers", "100000000"], "must be an integer from 0 to 4,096"),
    (["tokenizer", "encode", "-t", "nosuch", "hi"], "unknown tokenizer"),
    (["tokenizer", "decode", "abc"], "takes token ids"),
    (["params", "--preset", "nope"], "unknown preset"),
]


@pytest.mark.parametrize("argv, pattern", BAD, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_line_and_touches_nothing(world, capsys, argv, pattern):
    before = snapshot(world["root"])
    code, err = run_cli(fill(argv, world), capsys)
    assert_one_line(code, err, pattern)
    assert snapshot(world["root"]) == before  # the run and everything beside it unchanged


def test_enough_bad_inputs():
    assert len(BAD) >= 40 and {a[0] for a, _ in BAD} >= {"train", "eval", "generate", "compare",
                                                          "quantize", "task"}


# ------------------------------------------------------------------ damaged checkpoints
def _copy(world, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(world["run"], run, symlinks=True)
    return run


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _forge(ckpt, name, text):
    """``name`` rewritten to ``text`` with the manifest made to match: damage a checksum cannot see."""
    (ckpt / name).write_text(text)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": file_sha256(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _trainer_meta(c, **change):
    return json.dumps({**json.loads((c / "trainer.json").read_text()), **change})


DAMAGE = [
    ("trainer.json missing", lambda c: (c / "trainer.json").unlink(), "trainer.json is missing", True),
    ("weights flipped", lambda c: _flip(c / "model.safetensors"), "model.safetensors differs", False),
    ("weights missing", lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing", False),
    ("trainer state truncated", lambda c: (c / "trainer.safetensors").write_bytes(
        (c / "trainer.safetensors").read_bytes()[:100]), "trainer.safetensors differs", True),
    ("manifest garbled", lambda c: (c / "manifest.json").write_text("{nope"), "manifest.json", False),
    ("manifest missing", lambda c: (c / "manifest.json").unlink(), "its manifest.json is missing", False),
    ("manifest a list", lambda c: (c / "manifest.json").write_text("[]"), "holds no file digests", False),
    ("manifest entry a number", lambda c: (c / "manifest.json").write_text(
        '{"files": {"model.safetensors": 3}}'), "manifest.json holds no file digests", False),
    ("trainer.json flipped", lambda c: (c / "trainer.json").write_text(
        (c / "trainer.json").read_text().replace('"step": 6', '"step": 5')), "trainer.json differs", True),
    # valid JSON of another shape, its checksum matching (a foreign or hand-made checkpoint)
    ("trainer.json a list", lambda c: _forge(c, "trainer.json", "[]"), "holds a JSON list", True),
    ("trainer.json empty object", lambda c: _forge(c, "trainer.json", "{}"), "its step is None", True),
    ("trainer.json step text", lambda c: _forge(c, "trainer.json", _trainer_meta(c, step="x")),
     "its step is 'x'", True),
    ("trainer.json optimizer gone", lambda c: _forge(c, "trainer.json", _trainer_meta(c, optimizer=None)),
     "optimizer entry is not", True),
    ("trainer.json of weights only", lambda c: _forge(c, "trainer.json", '{"step": 6}'),
     "holds weights only (no optimizer state), which a run cannot resume from: continue from them with "
     "--init-from RUN", True),
    ("trainer.json param group without params", lambda c: _forge(c, "trainer.json", _trainer_meta(
        c, optimizer={"state": {}, "param_groups": [{}]})), "param_groups of parameter indices", True),
    ("trainer.json one param group too many", lambda c: _forge(c, "trainer.json", _trainer_meta(
        c, optimizer={**json.loads((c / "trainer.json").read_text())["optimizer"], "param_groups": [
            *json.loads((c / "trainer.json").read_text())["optimizer"]["param_groups"], {"params": []}]})),
     "optimizer state does not fit this run's optimizer", True),
    ("trainer.json optimizer tensor unknown", lambda c: _forge(c, "trainer.json", _trainer_meta(
        c, optimizer={"state": {"0": ["nosuch"]}, "param_groups": [{"params": [0]}]})), "names tensors", True),
]


@pytest.mark.parametrize("what, damage, pattern, weights_ok", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_checkpoint_is_refused_by_name(world, tmp_path, capsys, what, damage, pattern, weights_ok):
    """Resume refuses (exit 2, nothing touched) and names the file; eval/generate load
    only verified weights (they need no optimiser state)."""
    run = _copy(world, tmp_path)
    (run / "summary.json").unlink()  # an unfinished run, so resume must read the checkpoint
    damage(run / "checkpoint")
    before = snapshot(run)
    code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
    assert_one_line(code, err, pattern)
    assert "damaged" in err
    for cmd in (["eval", run, "--windows", "2"], ["generate", run, "--max-new-tokens", "2"]):
        code, err = run_cli(cmd, capsys)
        if weights_ok:
            assert code == 0, err
        else:
            assert_one_line(code, err, "damaged")
    assert snapshot(run) == before


def test_malformed_metrics_line_is_refused_and_a_torn_last_line_dropped(world, tmp_path, capsys):
    run = _copy(world, tmp_path)
    (run / "summary.json").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    before = snapshot(run)
    code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
    assert_one_line(code, err, "metrics.jsonl line 2 is not valid JSON")
    assert snapshot(run) == before
    # a kill during an append leaves a cut last line: dropped, the run resumes
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "lo')
    code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
    assert code == 0, err
    assert (run / "metrics.jsonl").read_text().splitlines() == lines


def test_a_lost_checkpoint_folder_is_not_a_fresh_start(world, tmp_path, capsys):
    """A finished run (or one that kept checkpoints) whose checkpoint/ folder is gone, or is
    a file, is refused by --resume instead of being trained again from step 0; a metrics
    file that is not UTF-8 is damage, named."""
    for damage, pattern in ((lambda r: shutil.rmtree(r / "checkpoint"), "finished (summary.json)"),
                            (lambda r: (shutil.rmtree(r / "checkpoint"), (r / "checkpoint").write_text("x")),
                             "has a checkpoint that is not a folder")):
        run = _copy(world, tmp_path / pattern[:4])
        damage(run)
        before = snapshot(run)
        code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
        assert_one_line(code, err, pattern)
        assert snapshot(run) == before
    run = _copy(world, tmp_path / "utf")
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes() + b"\xff\n")
    code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
    assert_one_line(code, err, "metrics.jsonl is not UTF-8 text")


def test_resume_cleans_orphans_and_refuses_nothing_it_should_not(world, tmp_path, capsys):
    run = _copy(world, tmp_path)
    (run / ".checkpoint.tmp-abc123").mkdir()
    (run / ".checkpoint.tmp-abc123" / "model.safetensors").write_bytes(b"half")
    (run / ".metrics.jsonl.x1.tmp").write_text("half")
    shutil.copytree(run / "checkpoint", run / ".checkpoint.old")
    code, err = run_cli(["train", "--out", run, "--resume", "--quiet"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_file_modes_agree(world):
    ckpt = world["run"] / "checkpoint"
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert (world["run"] / "config.json").stat().st_mode & 0o777 == modes["model.safetensors"]


def test_quantized_file_mode_is_its_report_s(world, tmp_path, capsys):
    run = _copy(world, tmp_path)
    code, err = run_cli(["quantize", run, "--bits", "8", "--windows", "2"], capsys)
    assert code == 0, err
    weights = next(run.glob("quant-*.safetensors"))
    assert weights.stat().st_mode & 0o777 == weights.with_suffix(".json").stat().st_mode & 0o777


def test_manifest_records_every_file(world):
    ckpt = world["run"] / "checkpoint"
    man = json.loads((ckpt / "manifest.json").read_text())
    assert man["step"] == 6
    for name in ("model.safetensors", "trainer.safetensors", "trainer.json"):
        assert man["files"][name] == {"bytes": (ckpt / name).stat().st_size, "sha256": file_sha256(ckpt / name)}


# ------------------------------------------------------------------ non-finite training
def _strict_load(text):
    def refuse(c):
        raise ValueError(f"non-strict JSON constant {c}")
    return json.loads(text, parse_constant=refuse)


def test_divergence_stops_with_exit_3_and_keeps_the_last_good_checkpoint(world, tmp_path, capsys):
    run = tmp_path / "div"
    code, err = run_cli(["train", *TINY, "--steps", "40", "--ckpt-every", "1", "--eval-every", "100",
                         "--log-every", "1", "--lr", "1e6", "--warmup", "0", "--data", world["text"],
                         "--out", run], capsys)
    assert code == 3, err
    assert len(err.splitlines()) == 1 and "training diverged" in err and "Traceback" not in err
    assert not (run / "summary.json").exists()
    for p in run.rglob("*.json*"):
        for line in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
            _strict_load(line)
    step = int(err.split("step ")[1].split(":")[0])
    model, _ = load_run(run)  # the checkpoint on disk: finite weights of the step before
    assert json.loads((run / "checkpoint" / "trainer.json").read_text())["step"] == step - 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert f"the checkpoint of step {step - 1} is intact" in err


class _Batches:
    def __init__(self):
        self.i = 0

    def next(self):
        self.i += 1
        return self.i

    def state(self):
        return {"i": torch.tensor(self.i)}

    def set_state(self, s):
        self.i = int(s["i"])


def _nan_on(bad_steps):
    def loss_fn(model, batch, device):
        x = torch.ones(2, 4)
        loss = model(x).pow(2).mean()
        if batch in bad_steps:
            loss = loss * float("nan")
        return ModelOutput(logits=x[:, :, None], loss=loss, ce_loss=loss.detach())
    return loss_fn


def test_skip_nonfinite_skips_and_counts_then_stops():
    """A skipped step changes no weight; the budget counts; past it the run stops."""
    tc = TrainConfig(steps=6, warmup_steps=0, log_every=1, eval_every=100, device="cpu", skip_nonfinite=2)
    t = Trainer(lambda: torch.nn.Linear(4, 4), tc, _Batches(), _nan_on({2, 4}))
    seen = []
    t.on_step = lambda step, rec: seen.append((step, {k: v.clone() for k, v in t.model.state_dict().items()}))
    s = t.fit()
    assert s["skipped_steps"] == 2 and s["step"] == 6
    for step in (2, 4):  # the NaN steps left the weights as the step before
        assert all(torch.equal(seen[step - 1][1][k], seen[step - 2][1][k]) for k in seen[0][1])
    assert not torch.equal(seen[2][1]["weight"], seen[1][1]["weight"])
    assert math.isnan(t.records[1]["loss"]) and t.records[-1]["skipped_steps"] == 2
    t2 = Trainer(lambda: torch.nn.Linear(4, 4), tc.replace(skip_nonfinite=1), _Batches(), _nan_on({2, 4}))
    with pytest.raises(DivergedError, match="step 4: loss nan.*1 skipped so far"):
        t2.fit()
    assert all(torch.isfinite(p).all() for p in t2.model.parameters())


def test_nan_weights_are_refused_everywhere(world, tmp_path, capsys):
    run = _copy(world, tmp_path)
    model, _ = load_run(run)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    save_checkpoint(run, model, None, 6)
    before = snapshot(run)
    for cmd in (["eval", run], ["generate", run], ["quantize", run, "--bits", "8"]):
        code, err = run_cli(cmd, capsys)
        assert_one_line(code, err, "hold NaN or inf")
    assert snapshot(run) == before


def test_json_files_are_strict(world):
    for p in world["run"].rglob("*.json*"):
        for line in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
            _strict_load(line)


# ------------------------------------------------------------------ the file system says no
def test_an_unwritable_out_is_one_line(world, tmp_path, capsys, monkeypatch):
    """Read-only folders (``os.access``; root ignores modes, so it is simulated) and a
    write that fails midway (disk full) each give one line."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
    code, err = run_cli(["train", *TINY, "--data", world["text"], "--out", tmp_path / "r"], capsys)
    assert_one_line(code, err, "is not writable")
    monkeypatch.undo()

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "r2" / "config.json"))
    monkeypatch.setattr("phaseloop.engine.run.write_json", full)
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", world["text"], "--out", tmp_path / "r2"],
                        capsys)
    assert_one_line(code, err, "No space left on device")


def test_read_unchanged_refuses_a_file_rewritten_while_read(tmp_path):
    """The exports' guard (deploy/run.py, hf/export.py): the digest taken before the read,
    and one line when the file changed (or vanished) meanwhile; no file: None, no check."""
    import hashlib

    from phaseloop import files
    from phaseloop.errors import PhaseloopError

    p = tmp_path / "model.safetensors"
    p.write_bytes(b"a" * 64)
    with files.read_unchanged(p, "run") as digest:
        pass
    assert digest["sha256"] == hashlib.sha256(b"a" * 64).hexdigest()
    for change in (lambda: p.write_bytes(b"b" * 64), p.unlink):
        p.write_bytes(b"a" * 64)
        with pytest.raises(PhaseloopError, match="run: its checkpoint changed while it was read"):
            with files.read_unchanged(p, "run"):
                change()
    with files.read_unchanged(None, "run") as digest:
        pass
    assert digest["sha256"] is None


def test_sha256_file_reads_a_settled_file_once_and_any_change_again(tmp_path, monkeypatch):
    """The digest is kept per (inode, size, mtime, ctime) for files older than 2 s, so a
    checkpoint verified twice is read once; a rewrite, or a file changed just now (file
    times are coarser than a fast rewrite), is read again."""
    import hashlib
    import os

    from phaseloop import files

    reads = []
    real = hashlib.file_digest
    monkeypatch.setattr(files.hashlib, "file_digest", lambda f, d: reads.append(f.name) or real(f, d))
    monkeypatch.setattr(files, "_SHA256", {})
    p = tmp_path / "w.bin"
    p.write_bytes(b"a" * 100)
    assert files.sha256_file(p) == files.sha256_file(p) == hashlib.sha256(b"a" * 100).hexdigest()
    assert len(reads) == 2  # just written: not trusted to the stat
    old = p.stat().st_mtime_ns - 10**10
    os.utime(p, ns=(old, old))
    monkeypatch.setattr(files.time, "time_ns", lambda: p.stat().st_ctime_ns + 3 * 10**9)
    files.sha256_file(p), files.sha256_file(p)
    assert len(reads) == 3  # settled: read once
    p.write_bytes(b"b" * 100)  # same size, new content
    os.utime(p, ns=(old, old))  # even with the old mtime: the ctime moved
    monkeypatch.setattr(files.time, "time_ns", lambda: p.stat().st_ctime_ns + 3 * 10**9)
    assert files.sha256_file(p) == hashlib.sha256(b"b" * 100).hexdigest()
    assert len(reads) == 4


def test_a_damaged_summary_is_refused_on_resume(tmp_path, capsys):
    """A finished seed's summary.json that does not parse, or is not an object, is damage:
    ``task --resume`` (as ``train --resume``) refuses it by name instead of writing anew."""
    argv = ["task", "--task", "copy", "--arch", "rope", "--steps", "2", "--batch-size", "2", "--seeds", "0",
            "--n-test", "5", "--quiet", "--out", tmp_path / "t"]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    summary = tmp_path / "t" / "seed-0" / "summary.json"
    for text, pattern in (("{", "summary.json: JSONDecodeError; the file is damaged"),
                          ("[1]", "holds a JSON list, not a run summary")):
        summary.write_text(text)
        before = snapshot(tmp_path / "t")
        code, err = run_cli([*argv, "--resume"], capsys)
        assert_one_line(code, err, pattern)
        assert snapshot(tmp_path / "t") == before
    # a task's seed folder is not an LM run, whatever --data says
    code, err = run_cli(["train", "--out", tmp_path / "t" / "seed-0", "--resume", "--data", "shakespeare"], capsys)
    assert_one_line(code, err, "is a run of `phaseloop task` / `babi`, not of `phaseloop train`")
    assert snapshot(tmp_path / "t") == before


def test_an_interrupt_names_what_the_command_leaves():
    """Ctrl-C / SIGTERM: a command that trains points at its checkpoints and --resume; one
    that reads (generate, eval, serve) or writes one file renamed in at its end (export,
    quantize) says nothing was left half-written, not that checkpoints are intact."""
    from phaseloop.cli.exits import interrupted

    assert interrupted(KeyboardInterrupt(), "train", "interrupted") == (
        "interrupted; checkpoints already written are intact (rerun the same command with --resume to continue)")
    for command in ("generate", "eval", "serve", "export", "quantize"):
        assert interrupted(KeyboardInterrupt(), command, "terminated") == "terminated; nothing was left half-written"
