"""Issue 24, classes 4, 6 and 7 (docs/reliability.md): run folders edited by hand, numbers
and names at the edges, work that is not bounded. Each bad input ends with exit 2 and one
line naming the problem and the fix, no traceback, and every file of the run (and the
working folder) byte-identical afterwards."""

import json
import shutil

import pytest
from conftest import TINY, assert_one_line, run_cli, snapshot, write_corpus

from phaseloop.cli import main
from phaseloop.engine.checkpoint import config_digest, read_run_config
from phaseloop.errors import PhaseloopError


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A finished tiny run: 6 steps, a record every step, evaluations and checkpoints every 3."""
    root = tmp_path_factory.mktemp("edits")
    text = write_corpus(root / "corpus.txt")
    run = root / "run"
    assert main(["train", *TINY, "--steps", "6", "--log-every", "1", "--eval-every", "3", "--ckpt-every", "3",
                 "--data", str(text), "--out", str(run)]) == 0
    return {"root": root, "run": run, "text": text}


@pytest.fixture
def run(made, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(made["run"], d)
    return d


def refused_untouched(argv, run, capsys, pattern, root=None):
    root = root or run
    before = snapshot(root)
    code, err = run_cli([str(run) if a == "RUN" else a for a in argv], capsys)
    assert_one_line(code, err, pattern)
    assert snapshot(root) == before


RESUME = ["train", "--out", "RUN", "--resume", "--quiet"]
EVAL = ["eval", "RUN", "--windows", "2", "--device", "cpu"]
QUANT = ["quantize", "RUN", "--bits", "8", "--windows", "2", "--device", "cpu"]
GEN = ["generate", "RUN", "--max-new-tokens", "2", "--device", "cpu"]


def _edit(run, fn):
    path = run / "config.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text())), indent=2))


def _drop_digest(run):
    """Make the checkpoint look like one of 0.1 (no digest of config.json)."""
    m = run / "checkpoint" / "manifest.json"
    m.write_text(json.dumps({k: v for k, v in json.loads(m.read_text()).items() if k != "config_sha256"}))


# ------------------------------------------------------------------ class 4: config.json
SECTIONS = [
    (cmd, edit, pattern)
    for cmd in (RESUME, EVAL, QUANT)
    for edit, pattern in (
        (lambda c: {k: v for k, v in c.items() if k != "model"}, "has no model section"),
        (lambda c: {k: v for k, v in c.items() if k != "train"}, "has no train section"),
        (lambda c: {k: v for k, v in c.items() if k != "data"}, "has no data section"),
        (lambda c: {**c, "model": [1, 2]}, "its model section is a JSON list"),
        (lambda c: {**c, "train": "fast"}, "its train section is a JSON str"),
        (lambda c: [c], "is not a run config"),
    )
] + [(GEN, lambda c: {**c, "data": None}, "its data section is a JSON NoneType")]


@pytest.mark.parametrize("argv, edit, pattern", SECTIONS,
                         ids=[f"{a[0]}-{i}" for i, (a, _, _) in enumerate(SECTIONS)])
def test_config_json_without_or_with_a_wrong_section_is_refused(run, capsys, argv, edit, pattern):
    _edit(run, edit)
    _drop_digest(run)  # the section check itself, as for a run of 0.1
    refused_untouched(argv, run, capsys, pattern)


EDITS = [("lr", 0.5), ("steps", 20), ("seed", 7), ("log_every", 2), ("seq_len", 16)]


@pytest.mark.parametrize("key, value", EDITS)
def test_a_hand_edited_setting_is_refused_on_resume_and_read(run, capsys, key, value):
    _edit(run, lambda c: {**c, "train": {**c["train"], key: value}})
    refused_untouched(RESUME, run, capsys, "config.json was changed after the checkpoint of step 6")
    refused_untouched(EVAL, run, capsys, "restore the file as the run wrote it")


def test_an_edited_model_is_refused_before_its_weights_are_read(run, capsys):
    _edit(run, lambda c: {**c, "model": {**c["model"], "d_ff": 8}})
    refused_untouched(QUANT, run, capsys, "was changed after the checkpoint")


def test_an_invalid_setting_of_an_old_run_is_named(run, capsys):
    _drop_digest(run)
    _edit(run, lambda c: {**c, "train": {**c["train"], "seq_len": "abc"}})
    refused_untouched(EVAL, run, capsys, "its train section is not valid (invalid train config: seq_len='abc'")


WRONG = [
    (EVAL, lambda c: {**c, "data": {}}, "names no data source"),
    (RESUME, lambda c: {**c, "data": {}}, "names no data source"),
    (EVAL, lambda c: {**c, "data": {**c["data"], "load": 5}}, "data.load is 5"),
    (QUANT, lambda c: {**c, "data": {**c["data"], "load": {}}}, "data.load names no source"),
    (GEN, lambda c: {**c, "data": {**c["data"], "tokenizer": 5}}, "data.tokenizer is 5"),
    (RESUME, lambda c: {**c, "parallel": []}, "its parallel section is a JSON list"),
    (RESUME, lambda c: {**c, "train": {**c["train"], "batch_size": "2"}}, "batch_size='2': must be an integer"),
]


@pytest.mark.parametrize("argv, edit, pattern", WRONG, ids=[f"{a[0]}-{i}" for i, (a, _, _) in enumerate(WRONG)])
def test_wrong_values_in_an_old_runs_sections_are_named(run, capsys, argv, edit, pattern):
    _edit(run, edit)
    _drop_digest(run)  # a run of 0.1: no digest, so the values themselves are checked
    refused_untouched(argv, run, capsys, pattern)


def test_the_digest_is_that_of_the_file_written_and_formatting_is_not_an_edit(run, capsys):
    cfg = json.loads((run / "config.json").read_text())
    manifest = json.loads((run / "checkpoint" / "manifest.json").read_text())
    assert manifest["config_sha256"] == config_digest(cfg)
    (run / "config.json").write_text(json.dumps(cfg))  # one line, other order: the same settings
    assert read_run_config(run) == cfg
    code, err = run_cli([a if a != "RUN" else str(run) for a in EVAL], capsys)
    assert code == 0, err


def test_a_run_without_digests_still_resumes(run, capsys):
    _drop_digest(run)
    before = snapshot(run)
    written = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    code, err = run_cli([a if a != "RUN" else str(run) for a in RESUME], capsys)
    assert code == 0, err
    assert snapshot(run) == before  # a finished run: nothing to do, nothing changed
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == written  # not even rewritten


# ------------------------------------------------------------------ class 4: metrics.jsonl
def _lines(run):
    return (run / "metrics.jsonl").read_text().splitlines()


def _write(run, lines, end="\n"):
    (run / "metrics.jsonl").write_text("\n".join(lines) + end)


METRICS = [
    (lambda L: [line for line in L if not ('"step": 2,' in line and '"lr"' in line)],
     "lacks the training record of step 2, before the checkpoint of step 6"),
    (lambda L: [line for line in L if not ('"step": 3,' in line and '"val_loss"' in line)],
     "lacks the evaluation record of step 3"),
    (lambda L: L[:1] + L[:1] + L[1:], "holds a training record of step 1 out of place"),
    (lambda L: L[:4] + [L[4][:25]], "lacks the training record of step 4"),  # torn at step <= 6
    (lambda L: L[:2] + [L[2][:30]] + L[3:], "line 3 is not valid JSON"),  # torn in the middle
    (lambda L: [], "lacks the training record of step 1"),
    (lambda L: L[:2] + ['{"step": "4", "loss": 1}'] + L[2:], """line 3 has no step number ("step": '4'"""),
    (lambda L: L[:4] + [L[4].replace('"step": 4,', '"step": 4.0,')] + L[5:], "line 5 has no step number"),
    (lambda L: L + ['{"loss": 99}'], "line 9 has no step number"),  # after the checkpoint too
    (lambda L: L[:1] + ['{"step": null}'] + L[1:], "line 2 has no step number"),
]


@pytest.mark.parametrize("damage, pattern", METRICS, ids=["gap", "eval-gap", "repeated", "torn-last-early",
                                                         "torn-middle", "emptied", "step-text", "step-float",
                                                         "no-step", "step-null"])
def test_metrics_damaged_before_the_checkpoint_is_refused(run, capsys, damage, pattern):
    _write(run, damage(_lines(run)))
    refused_untouched(RESUME, run, capsys, pattern)


@pytest.mark.parametrize("value", ["2", None, 0, True])
def test_a_hand_edited_world_size_is_refused_by_every_reader(run, capsys, value):
    """Where no digest guards config.json (a run of 0.1), parallel.world_size must still
    be a whole number of processes, for resume and for the readers."""
    _drop_digest(run)
    _edit(run, lambda c: {**c, "parallel": {"world_size": value}})
    for argv in (RESUME, EVAL):
        refused_untouched(argv, run, capsys, f"parallel.world_size is {value!r}, not the positive whole number")


def test_resuming_with_init_from_a_run_trained_without_it_says_so(made, run, capsys):
    refused_untouched([*RESUME, "--init-from", str(made["run"])], run, capsys,
                      "was trained without --init-from, which a resumed run cannot add; resume without")


def test_a_run_without_its_config_is_damaged_not_foreign(run, capsys):
    (run / "config.json").unlink()
    refused_untouched([*RESUME, "--preset", "rope-tiny"], run, capsys,
                      "holds a run's checkpoint/ or metrics.jsonl but no config.json: the run is damaged")


def test_deleted_metrics_is_refused_not_taken_for_none(run, capsys):
    (run / "metrics.jsonl").unlink()
    refused_untouched(RESUME, run, capsys, "metrics.jsonl is missing")


def test_records_after_the_checkpoint_and_a_torn_last_line_still_resume(made, tmp_path, capsys):
    """What a kill leaves (a checkpoint of step 3, records of steps 4 and 5, a torn line)
    is not damage: the records past the checkpoint are logged again."""
    from phaseloop.config import ModelConfig
    from phaseloop.engine import TrainConfig
    from phaseloop.lm.train import train

    cfg = ModelConfig.from_preset("rope-tiny", n_layers=1)
    tc = TrainConfig(steps=6, batch_size=2, eval_every=3, eval_windows=2, warmup_steps=1, ckpt_every=3, log_every=1)
    train(cfg, tc, made["text"], tmp_path / "part", progress=False, stop_after=5)
    run = tmp_path / "part"
    _write(run, _lines(run) + ['{"step": 6, "lo'], end="")
    code, err = run_cli(["train", "--out", str(run), "--resume", "--quiet"], capsys)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in _lines(run) if "lr" in line] == [1, 2, 3, 4, 5, 6]


def test_a_last_record_without_its_newline_is_ended_on_resume(made, tmp_path, capsys):
    """A kill between a record and its newline leaves a whole last line without one: the
    resume ends it before it appends (the next record would otherwise join it)."""
    from phaseloop.config import ModelConfig
    from phaseloop.engine import TrainConfig
    from phaseloop.lm.train import train

    cfg = ModelConfig.from_preset("rope-tiny", n_layers=1)
    tc = TrainConfig(steps=6, batch_size=2, eval_every=3, eval_windows=2, warmup_steps=1, ckpt_every=3, log_every=1)
    train(cfg, tc, made["text"], tmp_path / "part", progress=False, stop_after=3)
    run = tmp_path / "part"
    _write(run, _lines(run), end="")
    code, err = run_cli(["train", "--out", str(run), "--resume", "--quiet"], capsys)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in _lines(run) if "lr" in line] == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------ class 6: numbers and names
TEXT = "{text}"
EDGES = [
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--min-frequency", "-1", "--out", "{tmp}/k"],
     "--min-frequency: -1 is out of range"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", str(2**70), "--out", "{tmp}/k"],
     "--vocab-size: 1180591620717411303424 is out of range"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--name", "../../x"], "is not a plain name"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--name", ""], "is not a plain name"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--name", "/tmp/x"], "is not a plain name"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--name", "a/b"], "is not a plain name"),
    (["tokenizer", "train", "--data", TEXT, "--vocab-size", "300", "--name", ".."], "is not a plain name"),
    (["params", "--seq-len", "-5"], "--seq-len: -5 is out of range"),
    (["params", "--seq-len", "0"], "--seq-len: 0 is out of range"),
    (["params", "--seq-len", "2147483647"], "--seq-len: 2147483647 is out of range"),  # T x T overflowed
    (["lm-eval", "{run}", "--tasks", "lambada_local", "--limit", "inf"], "--limit: inf is not a finite number"),
    (["lm-eval", "{run}", "--tasks", "lambada_local", "--limit", "nan"], "--limit: nan is not a finite number"),
    (["lm-eval", "{run}", "--tasks", "lambada_local", "--limit", "0"], "--limit: 0 must be a finite number > 0"),
    (["generate", "{run}", "--top-k", "0"], "--top-k: 0 is out of range"),
    (["quantize", "{run}", "--bits", "8", "--calib-batch-size", "0"], "--calib-batch-size: 0 is out of range"),
    (["quantize", "{run}", "--bits", "8", "--group-size", "-2"], "--group-size: -2 is out of range"),
    (["demo", "parity", "--length", "0"], "--length: 0 is out of range"),
    (["train", *TINY, "--steps", str(2**70), "--out", "{tmp}/t"], "--steps: 1180591620717411303424 is out of range"),
    (["train", *TINY, "--seed", str(2**64), "--out", "{tmp}/t"], "--seed: 18446744073709551616 is out of range"),
    (["task", "--task", "copy", "--seeds", str(2**70), "--steps", "1", "--out", "{tmp}/t"],
     "--seeds: seed 1180591620717411303424 is out of range"),
    (["babi", "--seeds", "-1", "--steps", "1", "--out", "{tmp}/t"], "--seeds: seed -1 is out of range"),
    (["compare", "--seeds", f"0,{2**70}", "--out", "{tmp}/t"], "--seeds: seed 1180591620717411303424 is out of"),
    (["task", "--task", "copy", "--train-len", f"1-{2**70}", "--steps", "1", "--out", "{tmp}/t"],
     "lengths must be at most 65,536"),
]


@pytest.mark.parametrize("argv, pattern", EDGES, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(EDGES)])
def test_numbers_and_names_at_the_edges_are_one_line(made, tmp_path, capsys, monkeypatch, argv, pattern):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(text=made["text"], tmp=tmp_path, run=made["run"]) for a in argv]
    before = snapshot(made["root"].parent)
    code, err = run_cli(argv, capsys)
    assert_one_line(code, err, pattern)
    assert snapshot(made["root"].parent) == before and not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["tokenizer", "train", "--data", "{text}", "--vocab-size", "300", "--name", "ok"],
                                  ["train", *TINY, "--steps", "2", "--data", "{text}", "--out", "r"],
                                  ["tokenizer", "stats", "--data", "{text}", "--quiet"]])
def test_an_empty_cache_variable_is_refused_not_the_working_folder(made, tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHASELOOP_CACHE", "")
    code, err = run_cli([a.format(text=made["text"]) for a in argv], capsys)
    assert_one_line(code, err, "PHASELOOP_CACHE is set but empty")
    assert not any(tmp_path.iterdir())


def test_the_library_refuses_the_same_names_and_numbers(made, tmp_path):
    from phaseloop.data.tokenizer_train import train_tokenizer

    for kw, words in (({"name": "../x"}, "not a plain name"), ({"name": ""}, "not a plain name"),
                      ({"out": tmp_path / "k", "min_frequency": -1}, "--min-frequency -1"),
                      ({"out": tmp_path / "k", "vocab_size": 2**70}, "--vocab-size")):
        args = {"vocab_size": 300, **kw}
        with pytest.raises(PhaseloopError, match=words):
            train_tokenizer(str(made["text"]), "bpe", args.pop("vocab_size"), progress=False, **args)
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ class 7: bounded work
BOUNDS = [
    (["params", "--set", "n_layers=100000"], "n_layers=100000: at most 1024 layers"),
    (["params", "--preset", "universal-tiny", "--set", "n_steps=100000"], "applies 100,000 layers a token"),
    (["params", "--set", "max_seq_len=2000000000"], "max_seq_len=2000000000: at most 16,777,216"),
    (["params", "--preset", "looped-tiny", "--set", "n_loops=100000"], "n_loops=100000: at most 4096 loops"),
    (["params", "--set", f"d_model={2**70}"], "d_model=1180591620717411303424: at most 2,147,483,647"),
    (["train", *TINY, "--set", f"vocab_size={2**70}", "--out", "{tmp}/t"], "vocab_size=1180591620717411303424: at"),
    (["train", *TINY, "--set", "n_layers=5000", "--out", "{tmp}/t"], "n_layers=5000: at most 1024 layers"),
]


@pytest.mark.parametrize("argv, pattern", BOUNDS, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(BOUNDS)])
def test_unbounded_sizes_are_refused_up_front(made, tmp_path, capsys, monkeypatch, argv, pattern):
    import time

    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    code, err = run_cli([a.format(tmp=tmp_path) for a in argv], capsys)
    assert_one_line(code, err, pattern)
    assert time.perf_counter() - t0 < 5 and not any(tmp_path.iterdir())


def test_a_calibration_batch_beyond_memory_is_refused_before_it_runs(run, capsys, monkeypatch):
    from phaseloop.engine import optim

    monkeypatch.setattr(optim, "available_memory", lambda device: 2**30)  # a 1 GiB machine
    refused_untouched(QUANT + ["--method", "gptq", "--calib-batch-size", "100000"], run, capsys,
                      "--calib-batch-size 100,000: a batch of 100,000 windows of 64 tokens needs at least")
    code, err = run_cli([a if a != "RUN" else str(run) for a in QUANT] + ["--method", "gptq", "--calib-batches", "1",
                                                                       "--calib-batch-size", "2"], capsys)
    assert code == 0, err  # a batch that fits runs


def test_a_recipe_seed_beyond_torch_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"name": "x", "variants": ["rope-tiny"], "seeds": [2**70]}))
    code, err = run_cli(["compare", recipe, "--out", tmp_path / "c"], capsys)
    assert_one_line(code, err, "integers from 0 to 2^63 - 1")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_finished_run_killed_before_its_summary_gets_its_last_evaluation(run, capsys):
    """A kill between the last checkpoint and summary.json: resuming writes the summary the
    uninterrupted run wrote, its validation figures read back from metrics.jsonl."""
    want = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    code, err = run_cli([str(run) if a == "RUN" else a for a in RESUME], capsys)
    assert code == 0, err
    got = json.loads((run / "summary.json").read_text())
    keys = [k for k in want if k.startswith("val_")]
    assert len(keys) >= 5 and {k: got.get(k) for k in keys} == {k: want[k] for k in keys}
