"""A separator token between documents in the token store (``--doc-sep``, issue 28): the
store holds its id exactly between documents, the document index still points at each
document's first token (the separator ends the document before it), the separator is part
of the store's identity, and train / eval / resume / compare read the same store."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import TINY, assert_one_line, run_cli

from phaseloop.data import load_corpus
from phaseloop.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["alpha beta gamma " * 20, "delta epsilon " * 25, "zeta eta theta " * 22]


def _folder(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i, text in enumerate(TEXTS):
        (d / f"doc{i}.txt").write_text(text)
    return d


def _check_separated(corpus, sep_id: int, encoded: list[np.ndarray]) -> None:
    """The store is doc0 SEP doc1 SEP doc2: the id between documents and nowhere else,
    each document start at its first token, just past a separator."""
    toks = np.asarray(corpus.tokens[:], dtype=np.int64)
    want = np.concatenate([np.concatenate([e, [sep_id]]) for e in encoded[:-1]] + [encoded[-1]])
    assert toks.tolist() == want.tolist()
    starts = corpus.doc_starts.tolist()
    assert starts == np.cumsum([0] + [len(e) + 1 for e in encoded[:-1]]).tolist()
    assert [int(toks[s]) for s in starts] == [int(e[0]) for e in encoded]
    assert [int(toks[s - 1]) for s in starts[1:]] == [sep_id] * (len(encoded) - 1)
    assert int((toks == sep_id).sum()) == len(encoded) - 1


def test_bytes_separator_between_documents_and_store_identity(tmp_path, monkeypatch):
    from phaseloop.data import store
    from phaseloop.data.sources import resolve

    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path / "cache"))  # its stores are broken below

    data = _folder(tmp_path)
    plain = load_corpus(str(data))
    sep = load_corpus(str(data), doc_sep="|")
    enc = [np.frombuffer(t.encode(), np.uint8).astype(np.int64) for t in TEXTS]
    _check_separated(sep, ord("|"), enc)
    assert bytes(plain.tokens[:]) == "\n".join(TEXTS).encode()  # without: the source's joiner, as before
    assert sep.describe()["doc_sep"] == "|" and "doc_sep" not in plain.describe()
    assert sep.args["doc_sep"] == "|" and "doc_sep" not in plain.args

    src, tok = resolve(str(data)), plain.tokenizer
    plain_dir, sep_dir = store.store_dir(src, tok), store.store_dir(src, tok, ord("|"))
    assert plain_dir != sep_dir and plain_dir.is_dir() and sep_dir.is_dir()
    assert json.loads((sep_dir / "manifest.json").read_text())["doc_sep_id"] == ord("|")
    # a store of the other kind under a run's folder name (renamed by hand) is refused, never read
    shutil.rmtree(plain_dir)
    shutil.copytree(sep_dir, plain_dir)
    with pytest.raises(DataError, match=r"joins documents with separator id 124, this run with no separator"):
        load_corpus(str(data))
    shutil.rmtree(sep_dir)
    shutil.copytree(plain_dir, sep_dir)
    (sep_dir / "manifest.json").write_text(json.dumps(
        {k: v for k, v in json.loads((sep_dir / "manifest.json").read_text()).items() if k != "doc_sep_id"}))
    with pytest.raises(DataError, match=r"no separator, this run with separator id 124; delete the folder"):
        load_corpus(str(data), doc_sep="|")


@pytest.mark.parametrize("text,n", [("ab", 2), ("", 0), ("é", 2)])
def test_a_separator_must_be_one_token(tmp_path, text, n):
    with pytest.raises(DataError, match=rf"--doc-sep .* encodes to {n} tokens with tokenizer bytes; pass text "
                                        "that is exactly one token"):
        load_corpus(str(_folder(tmp_path)), doc_sep=text)


def test_bpe_special_token_separator(tmp_path):
    """A BPE's special token is one id between documents; the plain text never holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    data = _folder(tmp_path)
    corpus = load_corpus(str(data), str(path), doc_sep="<|endoftext|>")
    eot = tok.token_to_id("<|endoftext|>")
    _check_separated(corpus, eot, [np.asarray(corpus.tokenizer.encode(t), np.int64) for t in TEXTS])
    n = len(corpus.tokenizer.encode("<|sep|>"))  # not a special token of this vocabulary
    assert n > 1
    with pytest.raises(DataError, match=f"encodes to {n} tokens"):
        load_corpus(str(data), str(path), doc_sep="<|sep|>")


def test_cli_train_eval_resume_read_the_same_store(tmp_path, capsys):
    from phaseloop.engine.checkpoint import load_run, run_corpus

    data = _folder(tmp_path)
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(data), "--steps", "4", "--eval-every", "2", "--ckpt-every", "2",
            "--seq-len", "32", "--doc-sep", "|", "--doc-mask", "--out", str(out)]
    from phaseloop.cli import main

    assert main([*argv, "--print-config"]) == 0
    assert 'doc_sep = "|"' in capsys.readouterr().out
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["data"]["doc_sep"] == "|" and cfg["data"]["load"]["doc_sep"] == "|"
    _, run_cfg = load_run(out, "cpu")
    again = run_corpus(out, run_cfg)  # what eval and quantize read
    assert bytes(again.tokens[:]) == "|".join(TEXTS).encode()
    code, err = run_cli(["eval", str(out), "--json", "--windows", "4"], capsys)
    assert code == 0, err
    code, err = run_cli(["train", "--resume", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err  # the recorded separator, without naming it again (else refused below)
    code, err = run_cli(["train", "--resume", "--out", str(out), "--quiet", "--doc-sep", "#"], capsys)
    assert_one_line(code, err, "was trained with --doc-sep '|', this run would use '#'; resume with the same --doc-sep")
    code, err = run_cli(["train", *TINY, "--data", str(data), "--doc-sep", "ab", "--out", str(tmp_path / "x")],
                        capsys)
    assert_one_line(code, err, "--doc-sep 'ab' encodes to 2 tokens")
    assert not (tmp_path / "x").exists()


def test_recipe_separator_and_per_variant_train(tmp_path):
    """A recipe's doc_sep builds the comparison's store; a variant's train table sets its
    own options (doc_mask), never the budget."""
    from phaseloop.compare import Recipe, RecipeError, run_comparison

    data = _folder(tmp_path)
    train = dict(steps=2, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1, eval_every=2, eval_windows=2,
                 ckpt_every=2, log_every=1)
    variants = ["rope", {"name": "rope docs", "spec": "rope", "train": {"doc_mask": True, "doc_positions": True}}]
    recipe = Recipe.from_dict(dict(name="t", data=str(data), scale="tiny", seeds=[0], doc_sep="|",
                                   variants=variants, train=train))
    assert not recipe.train_config(0).doc_mask and recipe.train_config(0, recipe.variants[1]).doc_mask
    run_comparison(recipe, tmp_path / "c", progress=False, log=None)
    runs = tmp_path / "c" / "runs"
    plain, docs = (json.loads((runs / n / "config.json").read_text()) for n in ("rope-s0", "rope-docs-s0"))
    assert plain["data"]["doc_sep"] == docs["data"]["doc_sep"] == "|"
    assert not plain["train"]["doc_mask"] and docs["train"]["doc_mask"] and docs["train"]["doc_positions"]
    for bad, match in (({"steps": 3}, "train: steps is shared by every variant"),
                       ({"doc_mask": 1}, "variant 'v' train: invalid train config: doc_mask=1"),
                       ({"no_such": 1}, "train: unknown key 'no_such'")):
        with pytest.raises(RecipeError, match=match):
            Recipe.from_dict(dict(name="t", data=str(data), scale="tiny", train=train,
                                  variants=[{"name": "v", "spec": "rope", "train": bad}]))
