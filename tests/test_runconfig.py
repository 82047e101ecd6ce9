"""The train flags generated from TrainConfig."""

import dataclasses

import pytest

from phaseloop.cli import build_parser, main
from phaseloop.cli import trainflags
from phaseloop.engine import OPTIMIZERS, TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

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
    args = parse(*argv, "--compile", "--checkpoint-activations", "--preset", "rope-tiny", "--set", "n_layers=2",
                 "--data", "x.txt", "--tokenizer", "bytes", "--text-column", "body", "--data-split", "test",
                 "--streaming", "--out", "o", "--resume", "--quiet")
    want = {"steps": 7, "batch_size": 3, "grad_accum": 2, "seq_len": 32, "lr": 0.01, "min_lr_ratio": 0.2,
            "warmup_steps": 5, "weight_decay": 0.05, "decay": "all", "loss_ignore_id": 0, "grad_clip": 0.5,
            "seed": 4, "eval_every": 9, "eval_windows": 8, "ckpt_every": 6, "log_every": 2, "val_fraction": 0.2,
            "device": "cpu", "parallel": "fsdp", "peak_tflops": 100.0, "skip_nonfinite": 2}
    assert trainflags.given(args) == {**want, "compile": True, "checkpoint_activations": True}
    assert (args.preset, args.set, args.data, args.tokenizer, args.text_column, args.data_split, args.streaming,
            args.out, args.resume, args.quiet) == ("rope-tiny", ["n_layers=2"], "x.txt", "bytes", "body", "test",
                                                   True, "o", True, True)
    assert parse("--warmup-steps", "5").warmup_steps == 5


def test_optimizer_choices_come_from_the_registry(monkeypatch, capsys):
    monkeypatch.setitem(OPTIMIZERS, "sgd", OPTIMIZERS["adamw"])
    assert parse("--optimizer", "sgd").optimizer == "sgd"
    monkeypatch.delitem(OPTIMIZERS, "sgd")
    one_line_error(capsys, run_main(["train", "--optimizer", "sgd"]), "--optimizer: invalid choice: 'sgd'")
