"""`phaseloop export --format executorch` without the slow part: every bad input is one line,
exit 2, nothing written; the three files land together or not at all (the lowering itself
is replaced by a stub here; tests/test_deploy_runtime.py lowers and runs real programs)."""

import importlib.util
import json
import os

import pytest
from conftest import run_cli, snapshot

pytest.importorskip("tokenizers")
if not os.environ.get("CI"):  # CI installs the deploy extra: a missing one fails there
    pytest.importorskip("executorch")

from phaseloop.deploy import pte
from phaseloop.deploy.run import sidecars
from phaseloop.deploy.runtime import PteModel

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--eval-windows", "1",
         "--warmup", "1", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A rope run, a hyperloop run (2 loops) and a pooled-MLP hyperloop run."""
    from conftest import write_corpus

    from phaseloop.cli import main

    root = tmp_path_factory.mktemp("deploy-runs")
    corpus = write_corpus(root / "corpus.txt")
    out = {}
    for name, args in (("rope", ["--preset", "rope-tiny", "--set", "n_layers=1"]),
                       ("hyperloop", ["--preset", "hyperloop-tiny"]),
                       ("pooled", ["--preset", "hyperloop-tiny", "--set", "hc_transition=pooled_mlp"])):
        assert main(["train", *args, *TRAIN, "--data", str(corpus), "--out", str(root / name)]) == 0
        out[name] = root / name
    return out


@pytest.fixture
def stub_lowering(monkeypatch):
    """``pte.lower`` returns fixed bytes (and records what it was given)."""
    seen = {}

    def lower(program, meta, backend="xnnpack"):
        seen.update(program=program, meta=meta, backend=backend)
        return b"PTE-BYTES"

    monkeypatch.setattr(pte, "lower", lower)
    return seen


@pytest.mark.parametrize("args, says", [
    (["--depth", "3"], "is a stack of distinct layers"),
    (["--dtype", "bfloat16"], "--dtype applies to --format hf / llama, not executorch"),
    (["--quantized", "q.safetensors"], "--quantized applies to --format hf / llama / gguf, not executorch"),
    (["--max-seq-len", "1000"], "--max-seq-len 1000: choose 2 .. 64"),
    (["--extend-loops", "last"], "--extend-loops applies with --depth"),
    (["--bits", "3"], "invalid choice: 3"),
])
def test_a_bad_option_is_one_line_and_writes_nothing(runs, tmp_path, capsys, stub_lowering, args, says):
    before = snapshot(runs["rope"])
    code, err = run_cli(["export", runs["rope"], "--format", "executorch", "--out", tmp_path / "m.pte", *args],
                        capsys)
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert list(tmp_path.iterdir()) == [] and snapshot(runs["rope"]) == before


def test_what_a_format_cannot_take_names_the_formats_that_take_it(runs, tmp_path, capsys, stub_lowering):
    code, err = run_cli(["export", runs["pooled"], "--format", "executorch", "--out", tmp_path / "m.pte"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--format executorch cannot take this hyperloop run: hc_transition='pooled_mlp'" in err
    assert err.endswith("it exports as: hf"), err
    code, err = run_cli(["export", runs["rope"], "--bits", "4", "--out", tmp_path / "hf"], capsys)
    assert code == 2 and "--bits applies to --format executorch, not hf" in err, err
    code, err = run_cli(["export", runs["hyperloop"], "--format", "executorch", "--depth", "3",
                         "--out", tmp_path / "m.pte"], capsys)  # past the trained loops
    assert code == 2 and "exceeds the 2 trained loops" in err and "--extend-loops last" in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_out_path_is_checked_before_anything_runs(runs, tmp_path, capsys, stub_lowering, monkeypatch):
    (tmp_path / "old.pte").write_bytes(b"keep me")
    (tmp_path / "a-file").write_text("x")
    for out, says in ((tmp_path / "m.bin", "is a .pte file"), (tmp_path / "old.pte", "old.pte exists"),
                      (tmp_path / "a-file" / "m.pte", "lies under the file")):
        code, err = run_cli(["export", runs["rope"], "--format", "executorch", "--out", out], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert (tmp_path / "old.pte").read_bytes() == b"keep me" and not stub_lowering
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "executorch" else real(n, *a))
    code, err = run_cli(["export", runs["rope"], "--format", "executorch", "--out", tmp_path / "m.pte"], capsys)
    assert code == 2 and "needs the executorch library" in err and "pip install 'phaseloop[deploy]'" in err


def test_the_files_and_the_record(runs, tmp_path, capsys, stub_lowering):
    from tokenizers import Tokenizer

    out = tmp_path / "sub" / "h.pte"
    code, err = run_cli(["export", runs["hyperloop"], "--format", "executorch", "--depth", "1", "--bits", "4",
                         "--max-seq-len", "32", "--out", out], capsys)
    assert code == 0, err
    tok, record = sidecars(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["h.json", "h.pte", "h.tokenizer.json"]
    assert out.read_bytes() == b"PTE-BYTES"
    assert Tokenizer.from_file(str(tok)).encode("hé\n").ids == list("hé\n".encode())  # = ByteTokenizer
    rec = json.loads(record.read_text())
    assert rec["arch"] == "hyperloop" and rec["depth"] == 1 and rec["bits"] == 4 and rec["tokenizer"] == tok.name
    assert rec["metadata"] == stub_lowering["meta"] and rec["metadata"]["get_max_seq_len"] == 32
    assert rec["metadata"]["get_bos_id"] == 10 and rec["metadata"]["get_eos_ids"] == []
    program = stub_lowering["program"]
    assert program.model.trunk.loops == 1 and program.max_len == 32
    assert rec["quantized_layers"] and "model.head" not in rec["quantized_layers"] and rec["head"] is False
    assert rec["passes"] == program.model.trunk.passes == 1
    assert rec["kv_cache_bytes"] == sum(b.nbytes for b in program.cache.buffers()) > 0
    assert all(type(program.get_submodule(n).weight).__name__ != "Parameter" for n in rec["quantized_layers"])


def test_a_full_disk_leaves_the_folder_as_it_was(runs, tmp_path, capsys, stub_lowering, monkeypatch):
    from phaseloop.deploy import run as deploy_run

    real, calls = os.fdopen, []

    def fdopen(fd, mode):
        f = real(fd, mode)
        calls.append(fd)
        if len(calls) == 3:  # the .pte, after both sidecars were staged
            f.write = lambda data: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f

    monkeypatch.setattr(deploy_run.os, "fdopen", fdopen)
    out = tmp_path / "new" / "m.pte"
    code, err = run_cli(["export", runs["rope"], "--format", "executorch", "--out", out], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"{out}: No space left on device" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_program_is_refused_by_name(tmp_path):
    from phaseloop.errors import CheckpointError

    bad = tmp_path / "cut.pte"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="cut.pte is not an ExecuTorch program this runtime loads"):
        PteModel(bad)


def test_generate_refuses_a_file_the_runtime_cannot_run(runs, tmp_path, capsys, stub_lowering, monkeypatch):
    """`generate FILE.pte`: a file its record describes but no runtime loads (the stub's
    bytes), and ExecuTorch's runtime missing: one line each, exit 2."""
    import sys

    from conftest import assert_one_line

    out = tmp_path / "stub.pte"
    assert run_cli(["export", runs["rope"], "--format", "executorch", "--out", out], capsys)[0] == 0
    code, err = run_cli(["generate", out, "--prompt", "a"], capsys)
    assert_one_line(code, err, "stub.pte is not an ExecuTorch program this runtime loads")
    monkeypatch.setitem(sys.modules, "phaseloop.deploy.runtime", None)  # import fails as without executorch
    code, err = run_cli(["generate", out, "--prompt", "a"], capsys)
    assert_one_line(code, err, "running a .pte needs ExecuTorch's runtime, which is not installed: pip install")


def test_torchao_installed_leaves_a_command_one_line(runs, tmp_path):
    """transformers imports torchao once it is installed (the deploy extra), which logged its
    missing CUDA kernels and a torch deprecation on every command's stderr."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "phaseloop", "export", str(runs["rope"]), "--bits", "4",
                        "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["phaseloop: error: --bits applies to --format executorch, not hf"]


def test_only_those_import_lines_are_dropped(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile", "E")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning"]


def test_prepare_refuses_a_cache_shorter_than_two_positions():
    """An exported program's cache holds 2 .. max_seq_len positions (a prompt token and
    one more), as its refusal says."""
    from phaseloop import ConfigError, ModelConfig, build_model
    from phaseloop.deploy.program import prepare

    model = build_model(ModelConfig.from_preset("rope-tiny"))
    for bad in (1, 0, model.cfg.max_seq_len + 1):
        with pytest.raises(ConfigError, match=f"--max-seq-len {bad}: choose 2 .. {model.cfg.max_seq_len}"):
            prepare(model, max_len=bad)
    assert prepare(model, max_len=2).max_len == 2
