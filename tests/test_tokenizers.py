"""Learned tokenizers, the token store, data sources beyond plain files, and runs that
keep their tokenizer (issue 12). Everything reads small files the tests write or the
real corpora in ../shared/data; nothing touches the network."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from phaseloop import ConfigError, DataError, ModelConfig, build_model
from phaseloop.cli import main
from phaseloop.data import eval_windows, load_corpus
from phaseloop.data import sources as S
from phaseloop.data import store as ST
from phaseloop.data.tokenizer import ByteTokenizer, load_tokenizer
from phaseloop.data.tokenizer_train import train_tokenizer
from phaseloop.engine import TrainConfig
from phaseloop.lm.train import evaluate, train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A 512-token byte-level BPE trained on Tiny Shakespeare (or, without the shared data, on
    the built-in corpus: a repeated line has too few pairs to fill 512 tokens)."""
    from conftest import shared_data_dir

    d = shared_data_dir()
    src = str(d / "tinyshakespeare" / "input.txt") if d else "stdlib"
    return train_tokenizer(src, "bpe", 512, tmp_path_factory.mktemp("bpe"), progress=False)


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    text = tmp_path_factory.mktemp("w") / "w.txt"
    text.write_text(("the cat sat on the mat . the dog sat on the log .\n" * 200) + "a rare word\n")
    return train_tokenizer(str(text), "wordlevel", 12, tmp_path_factory.mktemp("wl"), progress=False)


UNICODE = "naïve café — ünïcödé ✓ 東京\n\n  indented line\n'quoted' -dash\n\ttab\nend"


# ---------------------------------------------------------------------------- tokenizers
def test_bpe_is_byte_level_with_exact_byte_counts(bpe):
    assert bpe.kind == "bpe" and bpe.vocab_size == 512 and len(bpe.sha256) == 64
    ids = bpe.encode(UNICODE)
    assert bpe.decode(ids) == UNICODE  # no unknown bytes
    assert int(bpe.window_bytes(ids[None]).sum()) == len(UNICODE.encode())  # exact per token
    assert bpe.chunk_safe


def test_wordlevel_min_frequency_keeps_the_words_seen_that_often(tmp_path):
    """--min-frequency is a word-level vocabulary's rarest word kept (it was ignored: 1)."""
    text = tmp_path / "w.txt"
    text.write_text("the cat sat on the mat\n" * 3 + "once\n")
    for min_f, has_once in ((None, True), (1, True), (2, False)):
        tok = train_tokenizer(str(text), "wordlevel", 100, tmp_path / f"wl{min_f}", min_frequency=min_f,
                              progress=False)
        assert ("once" in tok.tok.get_vocab()) == has_once and tok.unk_id is not None


def test_wordlevel_has_unk_and_counts_decoded_bytes(words):
    assert words.kind == "wordlevel" and words.vocab_size == 12
    ids = words.encode("the zebra sat")
    assert words.tok.id_to_token(int(ids[1])) == "[UNK]"
    assert words.decode(ids) == "the [UNK] sat"
    assert words.window_bytes(ids[None]).tolist() == [len("the [UNK] sat")]


def test_load_tokenizer_by_path_folder_name_and_errors(bpe, tmp_path, monkeypatch):
    assert load_tokenizer(str(bpe.path)).sha256 == bpe.sha256
    assert load_tokenizer(str(bpe.path.parent)).sha256 == bpe.sha256
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path / "cache"))
    named = train_tokenizer(str(bpe.path), "bpe", 300, name="mine", progress=False)
    assert load_tokenizer("mine").sha256 == named.sha256
    with pytest.raises(ConfigError, match="unknown tokenizer 'nope'.*mine"):
        load_tokenizer("nope")
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="is not a tokenizer file"):
        load_tokenizer(str(junk))
    with pytest.raises(ConfigError, match="below the byte alphabet"):
        train_tokenizer(str(bpe.path), "bpe", 100, tmp_path / "small", progress=False)
    with pytest.raises(ConfigError, match="exists"):
        train_tokenizer(str(bpe.path), "bpe", 300, name="mine", progress=False)  # never overwritten


# ---------------------------------------------------------------------------- the store
def _chunky(monkeypatch):
    """Small pieces, batches and shards, so one file crosses every boundary."""
    monkeypatch.setattr(S, "PIECE", 512)
    monkeypatch.setattr(S, "BLOCK", 4096)


def test_store_equals_encoding_the_whole_text(bpe, tmp_path, monkeypatch):
    _chunky(monkeypatch)
    f = tmp_path / "t.txt"
    f.write_text(UNICODE * 40 + "\n" + "words and more words\n" * 300)
    st = ST.build(S.resolve(f), bpe, batch_bytes=3000, shard_tokens=700)
    assert len(st.manifest["shards"]) > 3 and st.manifest["bytes"] == f.stat().st_size
    assert st.tokens[:].tolist() == bpe.encode(f.read_text()).tolist()
    assert st.manifest["tokenizer_sha256"] == bpe.sha256 and st.manifest["dtype"] == "uint16"
    b = ST.build(S.resolve(f), ByteTokenizer(), batch_bytes=3000, shard_tokens=700)
    assert bytes(b.tokens[:]) == f.read_bytes() and b.manifest["dtype"] == "uint8"


def test_store_equals_the_whole_where_a_line_starts_with_a_unicode_space(tmp_path, monkeypatch):
    """A newline before a no-break, ideographic, em or NEL space is no place to cut: the
    pre-tokenizer joins " \\n" there, which a cut before the newline would split."""
    from phaseloop.data.tokenizer_train import train_tokenizer

    _chunky(monkeypatch)
    src = tmp_path / "train.txt"
    src.write_text("the line ends . \n\nand the next one\n" * 300)
    bpe = train_tokenizer(str(src), "bpe", 300, tmp_path / "tok", progress=False)
    assert [bpe.decode([i]) for i in bpe.encode(" \n")] == [" \n"]  # one token: a cut would split it
    assert bpe.chunk_safe
    for ws in ("\u00a0", "\u3000", "\u2003", "\u0085"):
        f = tmp_path / "t.txt"
        f.write_text("".join(f"line {i} of the text . \n{ws}next part {i}\n" for i in range(200)))
        st = ST.build(S.resolve(f), bpe, batch_bytes=3000, shard_tokens=700)
        assert st.tokens[:].tolist() == bpe.encode(f.read_text()).tolist(), repr(ws)


def test_store_equals_the_whole_on_real_text(bpe, words, data_dir, tmp_path, monkeypatch):
    """Shakespeare (lines start with letters) and WikiText (lines start with a space, runs
    of blank lines): cut every ~512 bytes, the tokens are those of the whole file."""
    _chunky(monkeypatch)
    text = ((data_dir / "tinyshakespeare" / "input.txt").read_bytes()[:60000]
            + (data_dir / "wikitext-2" / "wiki.valid.raw").read_bytes()[:60000])
    f = tmp_path / "mixed.txt"
    f.write_bytes(text)
    for tok in (bpe, words):
        st = ST.build(S.resolve(f), tok, batch_bytes=8000)
        assert st.tokens[:].tolist() == tok.encode(text).tolist(), tok.kind


def test_token_view_slices_across_shards_like_one_array():
    parts = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 20)]
    v = ST.TokenView(parts)
    full = np.arange(20)
    for a, b in ((0, 20), (3, 7), (5, 6), (4, 19), (10, 10), (-3, None)):
        assert v[a:b].tolist() == full[a:b].tolist()
    w = v.view(4, 17)
    assert len(w) == 13 and w[2:9].tolist() == full[6:13].tolist() and w[-1] == 16


def test_interrupted_build_leaves_no_trusted_store_and_damage_is_refused(bpe, tmp_path, monkeypatch):
    _chunky(monkeypatch)
    f = tmp_path / "t.txt"
    f.write_text("some text here\n" * 2000)
    src = S.resolve(f)
    calls = {"n": 0}
    real = bpe.encode_batch

    def dies(pieces):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(pieces)

    monkeypatch.setattr(bpe, "encode_batch", dies)
    with pytest.raises(KeyboardInterrupt):
        ST.build(src, bpe, batch_bytes=2000)
    final = ST.store_dir(src, bpe)
    assert not final.exists() and not list(final.parent.glob(f".{final.name}.tmp-*"))
    monkeypatch.setattr(bpe, "encode_batch", real)
    st = ST.build(src, bpe, batch_bytes=2000)
    shard = final / st.manifest["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated: refused, never taken as absent
    with pytest.raises(DataError, match="damaged"):
        ST.build(src, bpe)


def test_peak_memory_is_bounded_not_proportional(tmp_path):
    """A 64 MB corpus builds under a data-segment limit of +16 MB (a quarter of it)."""
    import subprocess
    import sys

    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        for _ in range(64):
            fh.write((b"line of text %d\n" % 7) * (1 << 16))
    code = f"""
import resource
from phaseloop import sources, store
from phaseloop.data.tokenizer import ByteTokenizer
def vmdata():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmData')) * 1024
src = sources.resolve({str(big)!r})
lim = vmdata() + (16 << 20)
resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))
st = store.build(src, ByteTokenizer(), batch_bytes=4 << 20)
print(st.manifest["tokens"])
"""
    env = {**__import__("os").environ, "PHASELOOP_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-500:]
    assert int(out.stdout.split()[-1]) == big.stat().st_size


# ---------------------------------------------------------------------------- sources
def test_jsonl_parquet_arrow_records_and_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"document number {i}\n", "id": i} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({"body": [r["text"] for r in rows], "id": [r["id"] for r in rows],
                      "title": [f"title {i}" for i in range(5)]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as fh, pa.ipc.new_file(fh, table.schema) as w:
        w.write_table(table)
    want = b"\n".join(r["text"].encode() for r in rows)
    a = load_corpus(tmp_path / "d.jsonl")
    assert bytes(a.tokens[:]) == want and len(a.doc_starts) == 5 and a.describe()["text_column"] == "text"
    for name in ("d.parquet", "d.arrow"):
        c = load_corpus(tmp_path / name, text_column="body")
        assert bytes(c.tokens[:]) == want and len(c.doc_starts) == 5
        with pytest.raises(DataError, match="no column 'text'.*body"):
            load_corpus(tmp_path / name)
    assert load_corpus(tmp_path / "d.parquet", text_column="body").fingerprint != \
        load_corpus(tmp_path / "d.parquet", text_column="title").fingerprint
    with pytest.raises(DataError, match="record 1: 'id' is a number"):  # never read as its repr
        load_corpus(tmp_path / "d.parquet", text_column="id")
    # damage and oddities: invalid UTF-8 in a string column is replaced (as in .jsonl), a line
    # nested too deeply is one line naming it, a non-UTF-8 file name in a folder is fine
    bad = pa.table({"text": pa.array([b"ok\n", b"caf\xe9\n"], pa.binary()).cast(pa.string(), safe=False)})
    with pa.OSFile(str(tmp_path / "bad.arrow"), "wb") as fh, pa.ipc.new_file(fh, bad.schema) as w:
        w.write_table(bad)
    assert bytes(load_corpus(tmp_path / "bad.arrow").tokens[:]) == "ok\n\ncaf\ufffd\n".encode()
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    with pytest.raises(DataError, match="deep.jsonl:1: .*nested too deeply"):
        load_corpus(tmp_path / "deep.jsonl")
    folder = tmp_path / "names"
    folder.mkdir()
    (folder / "a.txt").write_text("one\n")
    (folder / os.fsdecode(b"caf\xe9.txt")).write_text("two\n")
    assert len(load_corpus(folder).doc_starts) == 2


def test_wikitext_articles_are_documents_and_split_by_document(data_dir):
    c = load_corpus(data_dir / "wikitext-2" / "wiki.valid.raw")
    assert len(c.doc_starts) == 60 and c.n_bytes == 1146846  # the 60 validation articles
    train_tok, val_tok = c.split(0.1, 129)
    cut = len(train_tok)
    assert cut in set(c.doc_starts.tolist())  # no article is split between train and val
    assert abs(len(val_tok) / len(c.tokens) - 0.1) < 0.05
    assert bytes(val_tok[:40]).startswith(b" = ")  # the held-out part starts at an article title


def test_single_document_split_is_todays_tail(text_file):
    c = load_corpus(text_file)
    tr, va = c.split(0.1, 33)
    assert len(va) == int(len(c.tokens) * 0.1)


def test_a_far_document_boundary_does_not_move_the_split(text_file, tmp_path):
    """A small file beside a large one: the only boundary is far from the 10 % cut, so the
    cut stays at the token (snapping there held out 99.8 % of the data)."""
    folder = tmp_path / "uneven"
    folder.mkdir()
    (folder / "a.txt").write_text("x" * 2000 + "\n")
    shutil.copyfile(text_file, folder / "b.txt")
    c = load_corpus(folder)
    tr, va = c.split(0.1, 33)
    assert len(va) == int(len(c.tokens) * 0.1)


def test_hf_datasets_offline_local_and_errors(tmp_path, monkeypatch):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["alpha beta\n", "gamma\n", "delta epsilon\n"]})
    ds.save_to_disk(str(tmp_path / "saved"))
    c = load_corpus(tmp_path / "saved")  # a save_to_disk folder
    assert bytes(c.tokens[:]) == b"alpha beta\n\ngamma\n\ndelta epsilon\n" and len(c.doc_starts) == 3
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    h = load_corpus(f"hf:{tmp_path / 'raw'}")  # datasets.load_dataset on a local folder
    assert bytes(h.tokens[:]) == b"one\ntwo" and h.describe()["source"].startswith("hf:")
    with pytest.raises(DataError, match="no column 'body'"):
        load_corpus(f"hf:{tmp_path / 'raw'}", text_column="body")
    empty = datasets.Dataset.from_dict({"text": []})
    empty.save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="empty"):
        load_corpus(tmp_path / "empty")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="offline, pass --data with a local"):
        load_corpus("hf:someone/corpus")


# ---------------------------------------------------------------------------- BPB and runs
def test_bpb_for_bytes_is_unchanged_and_exact_for_bpe(bpe, data_dir):
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset("rope-tiny"))
    c = load_corpus("shakespeare")
    w = eval_windows(c.split(0.1, 33)[1], 32, 4)
    r = evaluate(m, w)
    assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2)) and r["val_tokens_per_byte"] == 1
    cb = load_corpus("shakespeare", bpe)
    mb = build_model(ModelConfig.from_preset("rope-tiny", vocab_size=512))
    wb = eval_windows(cb.split(0.1, 33)[1], 32, 4)
    rb = evaluate(mb, wb, bpe)
    n_bytes = sum(len(bpe.decode(row).encode()) for row in wb[:, 1:].tolist())
    assert rb["val_bpb"] == pytest.approx(rb["val_loss"] * rb["val_tokens"] / (math.log(2) * n_bytes))
    assert 0.2 < rb["val_tokens_per_byte"] < 1


def test_wordlevel_run_reports_word_perplexity(words, tmp_path):
    f = tmp_path / "w.txt"
    f.write_text("the cat sat on the mat . the dog sat on the log .\n" * 300)
    cfg = ModelConfig.from_preset("rope-tiny", vocab_size=words.vocab_size, max_seq_len=16)
    tc = TrainConfig(steps=3, batch_size=2, eval_every=3, eval_windows=2, ckpt_every=3, log_every=1)
    s = train(cfg, tc, load_corpus(f, words), tmp_path / "run", progress=False)
    assert s["val_word_ppl"] == pytest.approx(s["val_ppl"])


def _run_cli(bpe, tmp_path, text_file, *extra):
    return main(["train", "--preset", "rope-tiny", "--data", str(text_file), "--tokenizer", str(bpe.path),
                 "--out", str(tmp_path / "run"), "--steps", "4", "--batch-size", "2", "--seq-len", "16",
                 "--eval-every", "2", "--eval-windows", "2", "--ckpt-every", "2", "--quiet", *extra])


def test_run_keeps_its_tokenizer_and_refuses_a_changed_one(bpe, tmp_path, text_file, capsys):
    assert _run_cli(bpe, tmp_path, text_file) == 0
    run = tmp_path / "run"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["tokenizer_sha256"] == bpe.sha256 and cfg["model"]["vocab_size"] == 512
    assert (run / "tokenizer.json").read_bytes() == bpe.path.read_bytes()
    assert "vocab_size 256 -> 512" in capsys.readouterr().err  # the preset's, adapted, and said so
    assert main(["eval", str(run), "--windows", "2", "--json"]) == 0  # uses the run's copy
    assert json.loads(capsys.readouterr().out)["val_tokens_per_byte"] < 1
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}

    other = train_tokenizer(str(text_file), "bpe", 300, tmp_path / "other", progress=False)
    assert main(["train", "--out", str(run), "--resume", "--tokenizer", str(other.path), "--quiet"]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    copy = run / "tokenizer.json"
    copy.write_text(copy.read_text().replace('"Ġt"', '"Ġx"', 1))  # the run's copy edited
    for argv in (["eval", str(run)], ["generate", str(run), "--max-new-tokens", "2"],
                 ["train", "--out", str(run), "--resume", "--quiet"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "has changed since the run was trained" in err[0], err
    copy.write_bytes(bpe.path.read_bytes())
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before


def test_a_tokenizer_in_a_folder_named_bytes_is_not_the_byte_tokenizer(bpe, tmp_path, text_file, capsys,
                                                                       monkeypatch):
    """Identity is the file's digest, not its folder's name: such a run evaluates and
    resumes with its own tokenizer; `tokenizer train --name bytes` is refused."""
    named = tmp_path / "bytes"
    named.mkdir()
    shutil.copyfile(bpe.path, named / "tokenizer.json")
    assert main(["train", "--preset", "rope-tiny", "--data", str(text_file), "--tokenizer", str(named),
                 "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--eval-windows", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--windows", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_tokens_per_byte"] < 1  # BPE, not bytes (1.0)
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--quiet"]) == 0  # not "another tokenizer"
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path / "cache"))
    assert main(["tokenizer", "train", "--data", str(text_file), "--vocab-size", "300", "--name", "bytes",
                 "--quiet"]) == 2
    assert "built-in byte tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("extra,msg", [
    (["--set", "vocab_size=300"], "smaller than the bpe"),
    (["--tokenizer", "/no/such/tokenizer.json"], "unknown tokenizer"),
    (["--data", "/no/such.jsonl"], "does not exist"),
])
def test_bad_tokenizer_input_one_line_exit_2(bpe, tmp_path, text_file, capsys, extra, msg):
    argv = ["train", "--preset", "rope-tiny", "--data", str(text_file), "--tokenizer", str(bpe.path),
            "--out", str(tmp_path / "run"), "--quiet", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "run").exists()


def test_cli_tokenizer_commands(tmp_path, text_file, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(text_file), "--vocab-size", "300", "--out", str(out),
                 "--quiet"]) == 0
    assert (out / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["tokenizer", "encode", "-t", str(out), "the quick brown fox"]) == 0
    ids = capsys.readouterr().out.split()
    assert main(["tokenizer", "decode", "-t", str(out), *ids]) == 0
    assert capsys.readouterr().out == "the quick brown fox\n"
    assert main(["tokenizer", "stats", "-t", str(out), "--data", str(text_file), "--quiet"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokens"] < stats["bytes"] and 256 < stats["tokenizer_vocab"] <= 300  # small corpus: fewer merges
    assert main(["tokenizer", "train", "--data", str(text_file), "--vocab-size", "64", "--out",
                 str(tmp_path / "t2"), "--quiet"]) == 2
    assert "below the byte alphabet" in capsys.readouterr().err


def test_compare_recipe_with_a_tokenizer(bpe, tmp_path, text_file):
    from phaseloop.compare import Recipe, run_comparison

    r = Recipe.from_dict(dict(name="t", data=str(text_file), tokenizer=str(bpe.path), scale="tiny",
                              seeds=[0], variants=["rope"],
                              train=dict(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_windows=2,
                                         ckpt_every=2, log_every=1)))
    s = run_comparison(r, tmp_path / "c", progress=False, log=None)
    assert s["data"]["tokenizer_sha256"] == bpe.sha256
    assert s["variants"][0]["model"]["vocab_size"] == 512


def test_jsonl_task_with_a_tokenizer(bpe, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": s, "target": s.upper()}) + "\n"
                            for s in ["to be", "or not", "that is", "the question", "whether", "tis nobler"]))
    assert main(["task", "--task", f"jsonl:{data}", "--tokenizer", str(bpe.path), "--set", "d_model=32",
                 "--set", "n_heads=2", "--set", "n_kv_heads=2", "--set", "d_ff=64", "--steps", "2",
                 "--out", str(tmp_path / "r"), "--quiet"]) == 0
    m = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert m["per_seed"][0]["model"]["vocab_size"] == 512 + 3
    assert main(["task", "--task", "copy", "--tokenizer", str(bpe.path), "--out", str(tmp_path / "q")]) == 2
    assert "applies to jsonl" in capsys.readouterr().err


def test_a_prompt_of_no_token_is_refused_in_one_line(words, tmp_path, capsys):
    """A word-level tokenizer has no token for a newline, which an empty prompt is fed as:
    `generate` failed with a TypeError traceback deep in the KV cache."""
    from conftest import assert_one_line, run_cli

    f = tmp_path / "w.txt"
    f.write_text("the cat sat on the mat . the dog sat on the log .\n" * 300)
    assert main(["train", "--preset", "rope-tiny", "--data", str(f), "--tokenizer", str(words.path), "--out",
                 str(tmp_path / "run"), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--quiet"]) == 0
    for prompt, what in (("", "an empty --prompt (fed as a newline)"), ("  ", "--prompt '  '")):
        code, err = run_cli(["generate", tmp_path / "run", "--prompt", prompt, "--max-new-tokens", "2"], capsys)
        assert_one_line(code, err, f"{what} encodes to no token with this model's tokenizer")
    assert main(["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
