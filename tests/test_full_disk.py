"""A full disk (issue 24, class 2) while writing weights: a checkpoint, an export or a
quantised file. safetensors reports it as its own SafetensorError, not an OSError; every
writer ends with one line naming the file the user asked for, exit 2, nothing
half-written and an existing run byte-identical. Tested on the real writer twice over:
a 64 KiB tmpfs (where this machine lets us mount one; skipped otherwise) and the error
raised from inside safetensors' own save path (``safetensors.torch.serialize_file``,
the Rust writer every ``save_file`` calls, transformers' ``save_pretrained`` included)."""

import os
import subprocess

import pytest
from conftest import TINY, run_cli, snapshot, tiny_run
from conftest import assert_one_line as _one_line
from safetensors import SafetensorError

from phaseloop.files import as_os_error

FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def assert_one_line(code, err, pattern, status=2):
    _one_line(code, err, pattern, status, prefix="phaseloop: error: ")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    made = tiny_run(tmp_path_factory.mktemp("disk"))
    return made


@pytest.fixture
def disk_full(monkeypatch):
    """Every safetensors write fails as on a full disk, from inside safetensors."""
    import safetensors.torch

    def full(*a, **k):
        raise SafetensorError(FULL)
    monkeypatch.setattr(safetensors.torch, "serialize_file", full)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs: room for config.json and metrics, none for weights."""
    where = tmp_path / "full"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:80]})")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


def _nothing_left(folder):
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name or p.suffix == ".safetensors")


# ------------------------------------------------------------- safetensors' own error, raised inside it
def test_a_checkpoint_of_a_new_run_on_a_full_disk(world, tmp_path, capsys, disk_full):
    out = tmp_path / "r"
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", world["text"], "--out", out], capsys)
    assert_one_line(code, err, f"{out / 'checkpoint' / 'model.safetensors'}: No space left on device")
    assert _nothing_left(out) == [] and not (out / "checkpoint").exists()


def test_a_later_checkpoint_on_a_full_disk_keeps_the_earlier_one(world, tmp_path, capsys, monkeypatch):
    """The disk fills after the checkpoint of step 2: that one stays, verified, no orphans."""
    import json

    import safetensors.torch

    from phaseloop.engine.checkpoint import verify_checkpoint

    real, calls = safetensors.torch.serialize_file, []

    def fills_up(*a, **k):
        calls.append(1)
        if len(calls) > 2:  # model + trainer of the first checkpoint fit
            raise SafetensorError(FULL)
        return real(*a, **k)
    monkeypatch.setattr(safetensors.torch, "serialize_file", fills_up)
    run = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--steps", "4", "--eval-every", "2", "--ckpt-every", "2",
                         "--data", world["text"], "--out", run], capsys)
    assert_one_line(code, err, "No space left on device")
    verify_checkpoint(run / "checkpoint")
    assert json.loads((run / "checkpoint" / "trainer.json").read_text())["step"] == 2
    assert not any(p.name.startswith(".") for p in run.iterdir())


def test_an_export_on_a_full_disk(world, tmp_path, capsys, disk_full):
    before = snapshot(world["root"])
    out = tmp_path / "hf"
    code, err = run_cli(["export", world["run"], "--out", out], capsys)
    assert_one_line(code, err, f"{out / 'model.safetensors'}: No space left on device")
    assert list(tmp_path.iterdir()) == [] and snapshot(world["root"]) == before


def test_an_export_into_an_empty_folder_on_a_full_disk_keeps_it(world, tmp_path, capsys, disk_full):
    out = tmp_path / "hf"
    out.mkdir()
    code, err = run_cli(["export", world["run"], "--out", out], capsys)
    assert_one_line(code, err, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and list(out.iterdir()) == []


def test_a_quantised_file_on_a_full_disk_into_the_run(world, capsys, disk_full):
    before = snapshot(world["root"])
    code, err = run_cli(["quantize", world["run"], "--bits", "8", "--windows", "2"], capsys)
    assert_one_line(code, err, "quant-w8-g128-rtn.safetensors: No space left on device")
    assert snapshot(world["root"]) == before  # no weights, no report, no temporary file


def test_a_quantised_file_on_a_full_disk_into_a_new_folder(world, tmp_path, capsys, disk_full):
    code, err = run_cli(["quantize", world["run"], "--bits", "4", "--windows", "2", "--out",
                         tmp_path / "a" / "q"], capsys)
    assert_one_line(code, err, "No space left on device")
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone again


def test_a_safetensors_error_without_an_errno_is_still_one_line(world, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def odd(*a, **k):
        raise SafetensorError("Error while serializing: something else")
    monkeypatch.setattr(safetensors.torch, "serialize_file", odd)
    code, err = run_cli(["export", world["run"], "--out", tmp_path / "hf"], capsys)
    assert_one_line(code, err, "could not be written (Error while serializing: something else)")


def test_as_os_error_reads_the_errno():
    e = as_os_error(SafetensorError(FULL), "x/model.safetensors")
    assert isinstance(e, OSError) and e.errno == 28 and e.filename == "x/model.safetensors"
    assert e.strerror == os.strerror(28)


# ------------------------------------------------------------- a real full disk (tmpfs)
def test_tmpfs_train(world, tiny_tmpfs, capsys):
    out = tiny_tmpfs / "r"
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", world["text"], "--out", out], capsys)
    assert_one_line(code, err, "checkpoint/model.safetensors: No space left on device")
    assert _nothing_left(tiny_tmpfs) == []


def test_tmpfs_export(world, tiny_tmpfs, capsys):
    code, err = run_cli(["export", world["run"], "--out", tiny_tmpfs / "hf"], capsys)
    assert_one_line(code, err, "hf/model.safetensors: No space left on device")
    assert list(tiny_tmpfs.iterdir()) == []


def test_tmpfs_quantize(world, tiny_tmpfs, capsys):
    before = snapshot(world["root"])
    code, err = run_cli(["quantize", world["run"], "--bits", "8", "--windows", "2", "--out", tiny_tmpfs / "q"],
                        capsys)
    assert_one_line(code, err, "q/quant-w8-g128-rtn.safetensors: No space left on device")
    assert list(tiny_tmpfs.iterdir()) == [] and snapshot(world["root"]) == before


def test_a_quantised_report_that_does_not_fit_leaves_no_weights(world, capsys, monkeypatch):
    """The weights fit, the report beside them does not: neither is left."""
    def full(path, obj):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr("phaseloop.quant.run.write_json", full)
    before = snapshot(world["root"])
    code, err = run_cli(["quantize", world["run"], "--bits", "8", "--windows", "2"], capsys)
    assert_one_line(code, err, "quant-w8-g128-rtn.json: No space left on device")
    assert snapshot(world["root"]) == before


@pytest.mark.parametrize("text, words", [
    (FULL, "No space left on device; check the path"),
    ("Error while deserializing header: HeaderTooLarge", "safetensors failed (Error while deserializing"),
])
def test_any_other_safetensors_error_is_one_line(capsys, monkeypatch, text, words):
    """The command line's backstop, for a safetensors call no writer or reader wrapped."""
    def fails(args):
        raise SafetensorError(text)
    monkeypatch.setattr("phaseloop.cli.info_cmds.cmd_archs", fails)
    code, err = run_cli(["archs"], capsys)
    assert_one_line(code, err, words)
