"""Configurations as files: `phaseloop train --config FILE` / `--print-config`, the train
flags generated from TrainConfig, and resolve_run, the one place a run is resolved."""

import dataclasses
import json

import pytest

from phaseloop.cli import build_parser, main, trainflags
from phaseloop.config import ModelConfig
from phaseloop.engine import OPTIMIZERS, TrainConfig
from phaseloop.errors import ConfigError
from phaseloop.lm.runconfig import TrainRun, read_config, resolve_run
from phaseloop.lm.train import train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "rope-tiny", "--set", "n_layers=1", "--steps", "4", "--batch-size", "2",
        "--eval-every", "2", "--eval-windows", "2", "--warmup", "1", "--schedule", "wsd",
        "--decay-fraction", "0.5", "--quiet"]


def parse(*argv):
    return build_parser().parse_args(["train", *argv])


def run_main(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return e.code


def one_line_error(capsys, code, *patterns):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for p in patterns:
        assert p in err, err


def printed(capsys, argv) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------------------- flags
def _value(f, tp):
    """A valid value other than the default, for a field of type ``tp``."""
    allowed = trainflags.choices(f.name)
    if allowed is not None:
        return allowed[-1] if allowed[-1] != f.default else allowed[0]
    if tp is str:
        return "cpu"
    return (f.default or 0) + 3 if tp is int else 0.5 if f.default != 0.5 else 0.25


def test_every_train_config_field_has_a_flag(capsys, monkeypatch):
    """--kebab-name for each field, typed from its annotation, its help and default in
    --help; booleans also --no-NAME; nothing given -> nothing set."""
    import typing

    hints = typing.get_type_hints(TrainConfig)
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping (textwrap breaks at hyphens)
    assert run_main(["train", "--help"]) == 0
    helptext = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        tp = trainflags._base(hints[f.name])
        if tp is bool:
            assert trainflags.given(parse(flag)) == {f.name: True}
            assert trainflags.given(parse("--no-" + flag[2:])) == {f.name: False}
        else:
            v = _value(f, tp)
            assert trainflags.given(parse(flag, str(v))) == {f.name: v}, flag
        assert flag in helptext and " ".join(f.metadata["help"].split()) in helptext, flag
        if f.default is not None:
            assert f"(default: {trainflags._show(f.default)})" in helptext
    assert trainflags.given(parse()) == {}
    assert "{cosine,wsd}" in helptext and "{matrices,all}" in helptext and "{ddp,fsdp}" in helptext


def test_the_flags_of_earlier_versions_still_parse():
    old = {"--steps": ("steps", "7"), "--batch-size": ("batch_size", "3"), "--grad-accum": ("grad_accum", "2"),
           "--seq-len": ("seq_len", "32"), "--lr": ("lr", "0.01"), "--min-lr-ratio": ("min_lr_ratio", "0.2"),
           "--warmup": ("warmup_steps", "5"), "--weight-decay": ("weight_decay", "0.05"),
           "--decay": ("decay", "all"), "--loss-ignore-id": ("loss_ignore_id", "0"),
           "--grad-clip": ("grad_clip", "0.5"), "--seed": ("seed", "4"), "--eval-every": ("eval_every", "9"),
           "--eval-windows": ("eval_windows", "8"), "--ckpt-every": ("ckpt_every", "6"),
           "--log-every": ("log_every", "2"), "--val-fraction": ("val_fraction", "0.2"),
           "--device": ("device", "cpu"), "--parallel": ("parallel", "fsdp"),
           "--peak-tflops": ("peak_tflops", "100"), "--skip-nonfinite": ("skip_nonfinite", "2")}
    argv = [a for flag, (_, v) in old.items() for a in (flag, v)]
    args = parse(*argv, "--compile", "model", "--checkpoint-activations", "--preset", "rope-tiny",
                 "--set", "n_layers=2",
                 "--data", "x.txt", "--tokenizer", "bytes", "--text-column", "body", "--data-split", "test",
                 "--streaming", "--out", "o", "--resume", "--quiet")
    want = {"steps": 7, "batch_size": 3, "grad_accum": 2, "seq_len": 32, "lr": 0.01, "min_lr_ratio": 0.2,
            "warmup_steps": 5, "weight_decay": 0.05, "decay": "all", "loss_ignore_id": 0, "grad_clip": 0.5,
            "seed": 4, "eval_every": 9, "eval_windows": 8, "ckpt_every": 6, "log_every": 2, "val_fraction": 0.2,
            "device": "cpu", "parallel": "fsdp", "peak_tflops": 100.0, "skip_nonfinite": 2}
    assert trainflags.given(args) == {**want, "compile": "model", "checkpoint_activations": True}
    assert (args.preset, args.set, args.data, args.tokenizer, args.text_column, args.data_split, args.streaming,
            args.out, args.resume, args.quiet) == ("rope-tiny", ["n_layers=2"], "x.txt", "bytes", "body", "test",
                                                   True, "o", True, True)
    assert parse("--warmup-steps", "5").warmup_steps == parse("--warm", "5").warmup_steps == 5  # one flag


def test_optimizer_choices_come_from_the_registry(monkeypatch, capsys):
    monkeypatch.setitem(OPTIMIZERS, "sgd", OPTIMIZERS["adamw"])
    assert parse("--optimizer", "sgd").optimizer == "sgd"
    monkeypatch.delitem(OPTIMIZERS, "sgd")
    one_line_error(capsys, run_main(["train", "--optimizer", "sgd"]), "--optimizer: invalid choice: 'sgd'")


# ---------------------------------------------------------------------------- round trip
def test_print_config_round_trips_to_the_same_run(tmp_path, text_file, capsys, monkeypatch):
    """--print-config, fed back through --config, resolves to the same configuration (and
    prints the same file), and trains a run whose config.json and results are identical."""
    monkeypatch.chdir(tmp_path)
    flags = [*TINY, "--data", str(text_file), "--set", "dropout=0.1", "--lr", "0.003"]
    text = printed(capsys, [*flags, "--out", "never"])
    assert not (tmp_path / "never").exists()  # nothing written, nothing trained
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    assert printed(capsys, ["--config", str(cfg)]) == text
    sections = read_config(cfg)
    assert sections["model"]["preset"] == "rope-tiny" and sections["train"]["schedule"] == "wsd"
    assert "# seq_len = none" in text and "seq_len" not in sections["train"]
    assert resolve_run(cfg).to_dict() == resolve_run(preset="rope-tiny", model={"n_layers": 1, "dropout": 0.1},
                                                     train=dict(steps=4, batch_size=2, eval_every=2, eval_windows=2,
                                                                warmup_steps=1, schedule="wsd", decay_fraction=0.5,
                                                                lr=0.003),
                                                     data={"source": str(text_file)}).to_dict()
    assert main(["train", *flags, "--out", "a"]) == 0
    assert main(["train", "--config", str(cfg), "--out", "b", "--quiet"]) == 0
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert a["val_loss"] == b["val_loss"] and a["step"] == 4
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["model"] == resolve_run(cfg).model.to_dict() and saved["train"]["schedule"] == "wsd"


@pytest.mark.parametrize("arch", ["universal", "hyperloop", "three_phase"])
def test_arch_at_its_defaults_round_trips(arch, tmp_path, capsys):
    """--arch X is X at its own defaults (ModelConfig(arch=X)), --set over them; the printed
    file holds [model] arch without a preset and reads back to the same file."""
    text = printed(capsys, ["--arch", arch, "--set", "dropout=0.1"])
    assert "preset" not in read_config_text(tmp_path, text)["model"]
    assert resolve_run(read_config_text(tmp_path, text)).model == ModelConfig(arch=arch, dropout=0.1)
    (tmp_path / "r.toml").write_text(text)
    assert printed(capsys, ["--config", str(tmp_path / "r.toml")]) == text
    assert main(["train", "--arch", arch, "--preset", "rope-tiny", "--print-config"]) == 2
    assert "--arch " + arch + " but the model is arch 'rope' (from --preset rope-tiny)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--preset", "rope-tiny", "--seq-len", "128"], "seq_len 128 is longer than the model's max_seq_len 64"),
    (["--preset", "rope-tiny", "--depth-sample", "2:6"], "depth_sample=2:6"),
    (["--preset", "rope-tiny", "--doc-sep", "ab"], "--doc-sep 'ab' encodes to 2 tokens"),
])
def test_print_config_refuses_what_training_refuses(argv, says, capsys):
    """A configuration --print-config prints is one --config then trains (these three were
    printed, rc 0, and refused only when training began)."""
    one_line_error(capsys, main(["train", *argv, "--print-config"]), says)


def read_config_text(tmp_path, text: str) -> dict:
    (tmp_path / "x.toml").write_text(text)
    return read_config(tmp_path / "x.toml")


def test_round_trip_with_a_learned_tokenizer(tmp_path, text_file, capsys):
    """A preset takes the tokenizer's vocabulary; the file holds it, read back as explicit."""
    from phaseloop.data.tokenizer_train import train_tokenizer

    tok = train_tokenizer(str(text_file), "bpe", 300, tmp_path / "bpe", progress=False)
    assert main(["train", "--preset", "3pt-tiny", "--tokenizer", str(tok.path), "--print-config"]) == 0
    text, err = capsys.readouterr()
    assert f"vocab_size = {tok.vocab_size}\n" in text and tok.vocab_size != 256
    assert f"note: vocab_size 256 -> {tok.vocab_size}" in err  # notes on stderr, the file alone on stdout
    (tmp_path / "r.toml").write_text(text)
    assert printed(capsys, ["--config", str(tmp_path / "r.toml")]) == text


def test_none_values_are_comments_and_must_come_back_as_none(tmp_path):
    spec = resolve_run(preset="looped-tiny")
    text = spec.to_toml()
    assert "\nn_begin = 1\n" in text and "\n# seq_len = none\n" in text
    (tmp_path / "r.toml").write_text(text)
    assert resolve_run(tmp_path / "r.toml").to_dict() == spec.to_dict()
    # n_begin=None (-> n_layers // 4) on a preset that sets n_begin: left out it would be 1
    bad = dataclasses.replace(spec, model=ModelConfig.from_preset("looped-tiny", n_begin=None))
    with pytest.raises(ConfigError, match="n_begin is none, which TOML cannot hold, and left out it would be 1"):
        bad.to_toml()


# ---------------------------------------------------------------------------- layering
def test_flags_override_the_file(tmp_path, text_file, capsys):
    other = tmp_path / "other.txt"
    other.write_text("x" * 100)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\npreset = "rope-tiny"\nn_layers = 1\ndropout = 0.1\n'
                   f'[train]\nsteps = 7\nlr = 0.01\ncompile = true\n'
                   f'[data]\nsource = "{text_file}"\ntext_column = "body"\n')
    spec = resolve_run(cfg)
    assert (spec.model.n_layers, spec.model.dropout, spec.model.d_model) == (1, 0.1, 96)
    # compile = true: the whole model, as before issue 30
    assert (spec.train.steps, spec.train.lr, spec.train.compile, spec.train.warmup_steps) == (7, 0.01, "model", 50)
    assert spec.data == {"source": str(text_file), "tokenizer": "bytes", "text_column": "body", "split": "train",
                         "streaming": False, "doc_sep": None}
    assert spec.preset == "rope-tiny" and spec.out.name.startswith("rope-tiny-")
    text = printed(capsys, ["--config", str(cfg), "--preset", "3pt-tiny", "--set", "n_layers=2", "--steps", "3",
                            "--compile", "off", "--data", str(other), "--text-column", "text"])
    (tmp_path / "flags.toml").write_text(text)
    spec = resolve_run(tmp_path / "flags.toml")
    assert (spec.model.arch, spec.model.n_layers, spec.model.dropout) == ("three_phase", 2, 0.1)
    assert (spec.train.steps, spec.train.lr, spec.train.compile) == (3, 0.01, "off")
    assert (spec.data["source"], spec.data["text_column"]) == (str(other), "text")


def test_resolve_run_from_python_with_a_dict(tmp_path, text_file):
    from phaseloop.lm.runconfig import train_run

    spec = resolve_run({"model": {"preset": "rope-tiny", "n_layers": 1}, "train": {"steps": 2, "batch_size": 2,
                        "eval_windows": 2, "warmup_steps": 1}, "data": {"source": str(text_file)}},
                       out=tmp_path / "r")
    assert isinstance(spec, TrainRun) and spec.out == tmp_path / "r" and not spec.out.exists()
    s = train_run(spec, progress=False)
    assert s["step"] == 2 and json.loads((tmp_path / "r" / "config.json").read_text())["train"]["steps"] == 2


# ---------------------------------------------------------------------------- resume
def test_resume_prints_the_saved_run_and_refuses_a_changed_file(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--out", str(run)]) == 0
    capsys.readouterr()
    text = printed(capsys, ["--out", str(run), "--resume"])
    assert "preset =" not in text and f'source = "{text_file}"' in text and 'schedule = "wsd"' in text
    (tmp_path / "r.toml").write_text(text)
    saved = json.loads((run / "config.json").read_text())
    assert resolve_run(tmp_path / "r.toml", out=run, resume=True).to_dict()["model"] == saved["model"]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    (tmp_path / "lr.toml").write_text(text.replace("lr = 0.001", "lr = 0.5"))
    one_line_error(capsys, main(["train", "--config", str(tmp_path / "lr.toml"), "--out", str(run), "--resume"]),
                   "different train config (lr: 0.001 there, 0.5 now)")
    assert before == {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}


def test_an_earlier_versions_run_resumes_through_the_cli_unchanged(tmp_path, text_file):
    """config.json without optimizer/schedule/decay_fraction (written before they existed):
    --resume continues with the defaults (AdamW, cosine) exactly as the whole run."""
    cfg, tc = ModelConfig.from_preset("rope-tiny", n_layers=1), TrainConfig(
        steps=6, batch_size=2, eval_every=3, eval_windows=2, warmup_steps=1, ckpt_every=3, log_every=1)
    train(cfg, tc, text_file, tmp_path / "full", progress=False)
    train(cfg, tc, text_file, tmp_path / "part", progress=False, stop_after=4)
    path = tmp_path / "part" / "config.json"
    old = json.loads(path.read_text())
    for k in ("optimizer", "schedule", "decay_fraction"):
        del old["train"][k]
    path.write_text(json.dumps(old))
    manifest = tmp_path / "part" / "checkpoint" / "manifest.json"  # nor did its checkpoints record a digest
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k != "config_sha256"}))
    assert main(["train", "--out", str(tmp_path / "part"), "--resume", "--quiet"]) == 0
    got, want = ([json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
                  if "loss" in json.loads(line)] for d in ("part", "full"))
    assert len(got) == 6 and got == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------------------- bad files
@pytest.mark.parametrize("text, patterns", [
    ("[trian]\nsteps = 3\n", ["unknown section [trian]", "did you mean [train]"]),
    ("[train]\nstpes = 3\n", ["unknown key 'stpes' in section [train]", "did you mean 'steps'"]),
    ("[model]\nn_layerz = 3\n", ["unknown key 'n_layerz' in section [model]"]),
    ("[data]\nsrc = 'x'\n", ["unknown key 'src' in section [data]", "'source'"]),
    ("steps = 3\n", ["steps = 3 is outside any section", "[train]"]),
    ("[train\nsteps = 3\n", ["not valid TOML", "line 1"]),
    ("[train.extra]\nx = 1\n", ["unknown key 'extra' in section [train]"]),
    ("[model]\nn_layers = { a = 1 }\n", ["[model] n_layers is a table"]),
    ("[train]\nsteps = \"3\"\n", ["steps='3': must be an integer"]),
    ("[model]\npreset = 3\n", ["preset=3: must be a preset name"]),
    ("[model]\npreset = \"nope\"\n", ["unknown preset 'nope'"]),
    ("[data]\nstreaming = \"yes\"\n", ["streaming='yes': must be true or false"]),
    ("[train]\nschedule = \"linear\"\n", ["schedule='linear': choose cosine or wsd"]),
    # integers past their bounds (issue 38, item 7): a 20-digit step count is past int64 already
    ("[train]\nsteps = 99999999999999999999\n", ["steps=99999999999999999999: at most 2,147,483,647"]),
    ("[train]\nsteps = 2147483648\n", ["steps=2147483648: at most 2,147,483,647 (2^31 - 1)"]),
    ("[train]\nwarmup_steps = 9223372036854775807\n", ["warmup_steps=9223372036854775807: at most 2,147"]),
    ("[train]\nloss_ignore_id = 99999999999\n", ["loss_ignore_id=99999999999: at most"]),
    ("[train]\nseed = 9223372036854775808\n", ["seed=9223372036854775808: at most 9,223,372,036,854,775,807"]),
    ("[train]\nseed = -1\n", ["seed=-1: must be an integer >= 0"]),
    ("[model]\nd_model = 99999999999999999999\n", ["d_model=99999999999999999999: at most 2,147,483,647"]),
    ("[model]\narch = \"universal\"\nn_steps = 4294967296\n", ["n_steps=4294967296: at most"]),
])
def test_a_bad_config_file_is_one_line_exit_2(text, patterns, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    for extra in ([], ["--print-config"]):
        code = run_main(["train", "--config", str(cfg), "--out", str(tmp_path / "r"), *extra])
        one_line_error(capsys, code, *patterns)
    assert not (tmp_path / "r").exists()


def test_integers_at_their_bounds_pass(tmp_path, capsys):
    """The largest seed torch takes (2^63 - 1) and MAX_INT steps print back as they are."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nseed = 9223372036854775807\nsteps = 2147483647\n")
    assert run_main(["train", "--config", str(cfg), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "seed = 9223372036854775807" in out and "steps = 2147483647" in out


def test_a_missing_or_unreadable_config_file(tmp_path, capsys):
    one_line_error(capsys, run_main(["train", "--config", str(tmp_path / "no.toml")]), "no.toml does not exist")
    one_line_error(capsys, run_main(["train", "--config", str(tmp_path)]), "is a folder")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[train]")
    one_line_error(capsys, run_main(["train", "--config", str(tmp_path / "bin.toml")]), "not UTF-8")
    with pytest.raises(ConfigError, match="unknown train key.*stpes"):
        resolve_run(train={"stpes": 3})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("[1, 2]")
    one_line_error(capsys, run_main(["train", "--out", str(tmp_path / "run"), "--resume", "--print-config"]),
                   "config.json is not a run config")


def test_a_preset_given_over_a_printed_config_is_that_preset(tmp_path, capsys):
    """`--config FILE --preset X` on a --print-config file (every field listed): the model is
    X's with the file's own changes of its preset, not the file's model relabelled."""
    f = tmp_path / "3pt.toml"
    f.write_text(printed(capsys, ["--preset", "3pt-tiny", "--set", "d_ff=96"]))
    out = printed(capsys, ["--config", str(f), "--preset", "rope-tiny"])
    assert 'arch = "rope"' in out and "n_phases = 1" in out and "d_ff = 96" in out  # the file's own change kept
    assert printed(capsys, ["--config", str(f)]).count('arch = "three_phase"') == 1
