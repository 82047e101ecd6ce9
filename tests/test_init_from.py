"""--init-from: a new run (own folder, config, optimiser) from another run's weights. The
weights arrive as they were (a longer max_seq_len computes the same function: positions
are computed by every built-in architecture); another architecture, another shape or
another tokenizer is a one-line error before anything is written (another tokenizer of
the same vocabulary size passes with --allow-new-tokenizer); the source is recorded in
config.json and in HF exports; such a run resumes exactly without its source."""

import json
import shutil

import pytest
import torch
from conftest import REPO, TINY, assert_one_line, run_cli, tiny_run
from safetensors.torch import load_file

from phaseloop import ModelConfig, build_model
from phaseloop.engine import TrainConfig, read_metrics
from phaseloop.engine.checkpoint import save_checkpoint
from phaseloop.engine.initfrom import load_init
from phaseloop.files import sha256_file as file_sha256
from phaseloop.files import write_json
from phaseloop.lm.train import train


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished rope-tiny run (4 steps, checkpoints every 2) on the repetitive corpus."""
    return tiny_run(tmp_path_factory.mktemp("source"))


def test_a_new_run_starts_from_the_weights_and_records_them(source, tmp_path, capsys):
    src, out = source["run"], tmp_path / "new"
    # lr 1e-9: one AdamW step moves a weight by ~1e-9, so the checkpoint is the source's
    code, err = run_cli(["train", *TINY, "--steps", "1", "--lr", "1e-9", "--warmup", "0", "--set", "max_seq_len=128",
                         "--data", source["text"], "--out", out, "--init-from", src], capsys)
    assert code == 0, err
    got, want = load_file(out / "checkpoint" / "model.safetensors"), load_file(src / "checkpoint" / "model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-7), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["max_seq_len"] == 128 and cfg["train"]["init_from"] == str(src)
    assert cfg["init"] == {"from": str(src.resolve()), "checkpoint": "checkpoint", "step": 4,
                           "model_sha256": file_sha256(src / "checkpoint" / "model.safetensors"),
                           "arch": "rope", "tokenizer": "bytes", "tokenizer_sha256": None,
                           "changed": {"max_seq_len": [64, 128]}}
    assert "note: --init-from" not in err  # max_seq_len changes no function: no note
    assert json.loads((out / "checkpoint" / "trainer.json").read_text())["step"] == 1  # its own optimiser
    pytest.importorskip("transformers")
    code, err = run_cli(["export", out, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "phaseloop.json").read_text())["init"] == cfg["init"]


def _saved_run(root, cfg: ModelConfig, seed: int):
    torch.manual_seed(seed)
    model = build_model(cfg)
    run_cfg = {"model": cfg.to_dict(), "train": {}, "data": {}}
    root.mkdir()
    write_json(root / "config.json", run_cfg)
    save_checkpoint(root, model, config=run_cfg)
    return model


@pytest.mark.parametrize("preset", ["rope-tiny", "3pt-tiny", "universal-act-tiny", "hyperloop-tiny"])
def test_a_longer_context_computes_the_same_function(tmp_path, preset):
    """RoPE, the 3PT horn and the UT coordinate signal are computed from positions: the
    model of a larger max_seq_len loaded from the weights gives the same logits (float64)."""
    short = ModelConfig.from_preset(preset, max_seq_len=16)
    src = _saved_run(tmp_path / "src", short, seed=1)
    torch.manual_seed(2)
    long = build_model(short.replace(max_seq_len=64))
    load_init(long, tmp_path / "src")
    x = torch.randint(0, short.vocab_size, (2, 16))
    want = src.double().eval()(x).logits
    got = long.double().eval()(x).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert long(torch.randint(0, short.vocab_size, (1, 64))).logits.shape == (1, 64, short.vocab_size)


def test_another_shape_or_arch_is_a_named_error(source, tmp_path, capsys):
    out = tmp_path / "new"
    base = ["train", *TINY, "--steps", "1", "--data", source["text"], "--out", out, "--init-from", source["run"]]
    code, err = run_cli([*base, "--set", "d_ff=96"], capsys)
    assert_one_line(code, err, "its weights do not fit this model")
    assert "ffn.gate_up.weight is [512, 96] there, [192, 96] here" in err and "d_ff 256 there, 96 here" in err, err
    assert not out.exists()
    code, err = run_cli([base[0], "--preset", "3pt-tiny", *base[3:]], capsys)
    assert_one_line(code, err, "is arch 'rope', this run's model is arch 'three_phase'")
    assert not out.exists()
    code, err = run_cli([*base[:-1], tmp_path / "nothing"], capsys)
    assert_one_line(code, err, "--init-from")
    code, err = run_cli(["train", *TINY, "--steps", "1", "--data", source["text"], "--out", out,
                         "--allow-new-tokenizer"], capsys)
    assert_one_line(code, err, "allow_new_tokenizer applies with init_from")


def test_the_tokenizer_must_be_the_same_unless_allowed_with_the_same_vocabulary(tmp_path, text_file, capsys):
    from phaseloop.data.tokenizer_train import train_tokenizer

    toks = {name: train_tokenizer(str(REPO / "src" / "phaseloop" / f), "bpe", size, tmp_path / name, progress=False)
            for name, f, size in (("a", "lm/train.py", 300), ("b", "config.py", 300), ("c", "lm/train.py", 320))}
    assert toks["a"].vocab_size == toks["b"].vocab_size != toks["c"].vocab_size
    src = tmp_path / "src"
    common = ["train", *TINY, "--steps", "1", "--seq-len", "16", "--data", text_file]
    code, err = run_cli([*common, "--tokenizer", toks["a"].path, "--out", src], capsys)
    assert code == 0, err
    out = tmp_path / "new"
    for tok, extra, want in (("a", [], None),
                             ("b", [], "use the same --tokenizer"),
                             ("b", ["--allow-new-tokenizer"], None),
                             ("c", ["--allow-new-tokenizer"], "of the same size"),
                             (None, [], "this run uses 'bytes'")):
        shutil.rmtree(out, ignore_errors=True)
        argv = [*common, "--out", out, "--init-from", src, *extra,
                *(["--tokenizer", toks[tok].path] if tok else [])]
        code, err = run_cli(argv, capsys)
        if want is None:
            assert code == 0, err
        else:
            assert_one_line(code, err, want)
            assert not out.exists()


def test_an_init_from_run_with_kept_checkpoints_resumes_exactly_without_its_source(tmp_path, text_file):
    cfg = ModelConfig.from_preset("rope-tiny", max_seq_len=16)
    src = tmp_path / "src"
    train(cfg, TrainConfig(steps=3, batch_size=2, eval_windows=2, warmup_steps=1), text_file, src, progress=False)
    tc = TrainConfig(steps=12, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=3, ckpt_every=5, log_every=1,
                     eval_windows=2, init_from=str(src), keep_checkpoints=2, keep_best=True)
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, tc, text_file, full, progress=False)
    train(cfg, tc, text_file, part, progress=False, stop_after=8)
    src.rename(tmp_path / "gone")  # the run's init section is recorded: the source is not read again
    train(cfg, tc, text_file, part, resume=True, progress=False)
    a, b = read_metrics(full), read_metrics(part)
    timing = ("tok_per_s", "elapsed_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in a] == \
        [{k: v for k, v in r.items() if k not in timing} for r in b]  # bitwise: the same process and data
    for name in ("best", "checkpoint", "checkpoint-00000012"):
        want, got = (load_file(r / name / "model.safetensors") for r in (full, part))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    init = [json.loads((r / "config.json").read_text())["init"] for r in (full, part)]
    assert init[0] == init[1] and init[0]["from"] == str(src.resolve())


def test_an_untied_source_into_a_tied_model_is_refused(source, tmp_path, capsys):
    """Both models list embed.tok.weight and head.weight: the names and shapes fit, and
    load_state_dict would copy the head last into the one shared tensor (issue 38, item 1)."""
    out = tmp_path / "new"
    code, err = run_cli(["train", *TINY, "--steps", "1", "--data", source["text"], "--out", out,
                         "--init-from", source["run"], "--set", "tie_embeddings=true"], capsys)
    assert_one_line(code, err, "this run ties it to the embedding: one tensor cannot take both")
    assert "--set tie_embeddings=false" in err and not out.exists()


def test_a_tied_source_into_an_untied_model_copies_the_embedding_into_the_head(tmp_path):
    """The head starts as the embedding: the same function (float64, to 1e-12), said in a note."""
    tied = ModelConfig.from_preset("rope-tiny", tie_embeddings=True)
    src = _saved_run(tmp_path / "src", tied, seed=1)
    untied = build_model(tied.replace(tie_embeddings=False))
    notes = []
    load_init(untied, tmp_path / "src", notes.append)
    assert untied.head.weight.data_ptr() != untied.embed.tok.weight.data_ptr()
    assert torch.equal(untied.head.weight, src.embed.tok.weight) and torch.equal(untied.embed.tok.weight,
                                                                                  src.embed.tok.weight)
    x = torch.randint(0, tied.vocab_size, (2, 16))
    assert torch.allclose(untied.double().eval()(x).logits, src.double().eval()(x).logits, rtol=0, atol=1e-12)
    assert len(notes) == 1 and "head.weight starts as a copy of embed.tok.weight" in notes[0], notes


def test_another_head_split_of_the_same_shapes_is_refused(source, tmp_path, capsys):
    out = tmp_path / "new"  # rope-tiny: d 96, 6/3 heads of 16; 12/6 heads of 8 have the same weight shapes
    code, err = run_cli(["train", *TINY, "--steps", "1", "--data", source["text"], "--out", out,
                         "--init-from", source["run"], "--set", "n_heads=12", "--set", "n_kv_heads=6"], capsys)
    assert_one_line(code, err, "n_heads 6 there, 12 here, n_kv_heads 3 there, 6 here: the same projection")
    assert not out.exists()


def test_fields_that_change_the_function_are_said_one_by_one_and_recorded(source, tmp_path, capsys):
    out = tmp_path / "new"
    code, err = run_cli(["train", *TINY, "--steps", "1", "--data", source["text"], "--out", out,
                         "--init-from", source["run"], "--set", "rope_base=500000", "--set", "embed_scale=true",
                         "--set", "use_rope=false", "--set", "dropout=0.1", "--set", "init_std=0.05"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: --init-from")]
    assert [n.split(": ")[2].split(" ")[0] for n in notes] == ["rope_base", "embed_scale", "use_rope"], err
    assert all("the weights now compute another function" in n for n in notes), notes
    changed = json.loads((out / "config.json").read_text())["init"]["changed"]
    assert changed == {"rope_base": [10000.0, 500000.0], "dropout": [0.0, 0.1], "embed_scale": [False, True],
                       "init_std": [0.02, 0.05], "use_rope": [True, False]}


def test_a_tokenizer_is_named_with_its_digest_only_where_it_has_one():
    from phaseloop.engine.initfrom import _named

    assert _named({"tokenizer": "bytes", "tokenizer_sha256": None}) == "'bytes'"  # not "sha256 None..."
    assert _named({"tokenizer": "t3", "tokenizer_sha256": "ab" * 32}) == "'t3' (sha256 abababababab...)"


def test_a_source_whose_weights_are_not_finite_is_refused_before_anything_is_written(tmp_path, capsys):
    """As every other reader of weights: NaN in one norm gain (or an embedding row no token
    of the corpus uses) is refused naming the tensor, not trained from (then taken for a
    divergence of the new run, exit 3, or trained on silently)."""
    cfg = ModelConfig.from_preset("rope-tiny", max_seq_len=16)
    model = _saved_run(tmp_path / "src", cfg, seed=0)
    with torch.no_grad():
        model.embed.tok.weight[cfg.vocab_size - 1, 0] = float("nan")  # a byte no text here holds
    save_checkpoint(tmp_path / "src", model, config=json.loads((tmp_path / "src" / "config.json").read_text()))
    text = tmp_path / "t.txt"
    text.write_text("plain ascii text, again and again. " * 200)
    out = tmp_path / "new"
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", text, "--out", out, "--init-from",
                         tmp_path / "src"], capsys)
    assert_one_line(code, err, "hold NaN or inf (embed.tok.weight): that run diverged; start from another run")
    assert not out.exists()
