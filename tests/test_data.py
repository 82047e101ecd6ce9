import hashlib
import math

import numpy as np
import pytest
import torch

from phaseloop import DataError
from phaseloop import data as D
from phaseloop.data import sources as S
from phaseloop.data.tokenizer import ByteTokenizer, get_tokenizer


def test_byte_tokenizer_roundtrip_any_bytes():
    tok = ByteTokenizer()
    text = "naïve — ünïcödé ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    raw = bytes(range(256))
    assert bytes(tok.encode(raw).tolist()) == raw
    assert (tok.window_bytes(np.zeros((3, 7), dtype=np.int64)) == 7).all() and tok.vocab_size == 256


def test_unknown_tokenizer():
    with pytest.raises(Exception, match="unknown tokenizer"):
        get_tokenizer("sentencepiece-9000")


def test_file_source_fingerprint_and_memmap(text_file):
    c = D.load_corpus(text_file)
    assert c.fingerprint == hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert isinstance(c.tokens.shards[0], np.memmap) and len(c.tokens) == text_file.stat().st_size
    assert bytes(c.tokens[:9]) == text_file.read_bytes()[:9]
    assert D.load_corpus(text_file).fingerprint == c.fingerprint  # cached path reused
    text_file.write_text(text_file.read_text() + "x")
    assert D.load_corpus(text_file).fingerprint != c.fingerprint


def test_folder_source(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_bytes(b"alpha" * 50)
    (tmp_path / "two.bin").write_bytes(bytes(range(256)))
    (tmp_path / ".hidden").write_bytes(b"secret")
    c = D.load_corpus(tmp_path)
    assert c.n_files == 2 and c.n_bytes == 250 + 256
    assert b"secret" not in bytes(c.tokens)


def test_stdlib_source_is_builtin_and_fingerprinted():
    root, files = D.stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    c = D.load_corpus("stdlib")
    d = c.describe()
    assert d["source"] == "stdlib" and len(d["fingerprint"]) == 64 and d["files"] == len(files)
    assert d["tokens"] > 1_000_000


@pytest.mark.parametrize("bad, msg", [("does/not/exist.txt", "does not exist"), ("", "does not exist")])
def test_missing_source(bad, msg):
    with pytest.raises(DataError, match=msg):
        D.load_corpus(bad or "/nonexistent-dir/")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    with pytest.raises(DataError, match="empty"):
        D.load_corpus(p)


def test_shakespeare_from_data_dir(data_dir):
    c = D.load_corpus("shakespeare")
    assert c.fingerprint == D.SHAKESPEARE_SHA256 and c.n_bytes == 1115394


def test_shakespeare_offline_without_copy_says_how_to_pass_data(monkeypatch, tmp_path):
    monkeypatch.delenv("PHASELOOP_DATA_DIR", raising=False)
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path))

    def offline(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(S.urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match="--data"):
        D.load_corpus("shakespeare")


def test_shakespeare_download_checks_sha256(monkeypatch, tmp_path):
    monkeypatch.delenv("PHASELOOP_DATA_DIR", raising=False)
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path))

    class Fake:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return b"not shakespeare"

    monkeypatch.setattr(S.urllib.request, "urlopen", lambda *a, **k: Fake())
    with pytest.raises(DataError, match="sha256"):
        D.load_corpus("shakespeare")
    assert not (tmp_path / "tinyshakespeare" / "input.txt").exists()


def test_split_is_deterministic_tail(text_file):
    c = D.load_corpus(text_file)
    tr, va = c.split(0.1, 33)
    n = len(c.tokens)
    assert len(va) == int(n * 0.1) and len(tr) + len(va) == n
    assert np.array_equal(va[:], c.tokens[n - len(va):])
    with pytest.raises(DataError, match="too small"):
        c.split(0.5, n)


def test_train_windows_random_contiguous_and_seeded(text_file):
    c = D.load_corpus(text_file)
    tr, _ = c.split(0.1, 17)
    a, b = D.TrainBatches(tr, 16, 4, seed=3), D.TrainBatches(tr, 16, 4, seed=3)
    x1, y1 = a.next()
    x2, y2 = b.next()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    raw = bytes(tr)
    for row in x1:
        assert bytes(row.tolist()) in raw  # contiguous window of the training split
    state = a.state()
    nxt = a.next()
    a.set_state(state)
    assert torch.equal(a.next()[0], nxt[0])
    assert not torch.equal(D.TrainBatches(tr, 16, 4, seed=4).next()[0], x1)


def test_eval_windows_fixed_and_cover_split(text_file):
    c = D.load_corpus(text_file)
    _, va = c.split(0.2, 17)
    w1, w2 = D.eval_windows(va, 16, 8), D.eval_windows(va, 16, 8)
    assert torch.equal(w1, w2) and w1.shape == (8, 17)
    assert bytes(w1[0].tolist()) == bytes(va[:17])
    assert bytes(w1[-1].tolist()) == bytes(va[-17:])


def test_bpb_is_nats_per_byte_over_ln2(text_file):
    from phaseloop import ModelConfig, build_model
    from phaseloop.lm.train import evaluate

    c = D.load_corpus(text_file)
    _, va = c.split(0.2, 17)
    m = build_model(ModelConfig.from_preset("rope-tiny"))
    r = evaluate(m, D.eval_windows(va, 16, 4), c.tokenizer)
    assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2))
    assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))


def test_jsonl_with_a_byte_order_mark_and_crlf(tmp_path):
    """Windows editors write a BOM (and CRLF): the first record is read, not refused."""
    f = tmp_path / "r.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "hello world"}\r\n{"text": "again"}\r\n')
    c = D.load_corpus(str(f))
    got = bytes(c.tokens[:])
    assert len(c.doc_starts) == 2 and got.startswith(b"hello world") and b"\xef" not in got


def test_safe_pieces_cut_a_stream_as_they_cut_the_whole(monkeypatch):
    """Blocks of any size give the pieces of the whole text at once (the search resumes
    where the last one ended: a line without a cut is scanned once, not once a block)."""
    import random
    import re

    monkeypatch.setattr(S, "PIECE", 64)
    rng = random.Random(0)
    alphabet = [b"a", b" ", b"\n", "\u00a0".encode(), b"x", b"\n ", "東".encode()]
    for _ in range(200):
        text = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 1500)))
        cuts = [m.start() for m in re.finditer(S._CUT, text)]
        want, start = [], 0
        while len(text) - start > S.PIECE:
            cut = next((c for c in cuts if c >= start + S.PIECE), None)
            if cut is None:
                break
            want.append(text[start:cut])
            start = cut
        want += [text[start:]] if start < len(text) else []
        sizes = iter(lambda: rng.randrange(1, 300), None)
        blocks, i = [], 0
        while i < len(text):
            k = next(sizes)
            blocks.append(text[i:i + k])
            i += k
        assert list(S.safe_pieces(blocks, False)) == want


def test_evaluation_builds_no_autograd_graph():
    from phaseloop import ModelConfig, build_model
    from phaseloop.lm.train import evaluate

    model, seen = build_model(ModelConfig.from_preset("rope-tiny")), []
    model.register_forward_hook(lambda m, i, o: seen.append(torch.is_grad_enabled()))
    evaluate(model, torch.randint(0, 256, (4, 17)))
    assert seen == [False]


def test_window_arithmetic_at_the_edges():
    """Evaluation windows of seq_len + 1 tokens start every seq_len tokens up to the last
    that fits (41 tokens, 10: 0, 10, 20, 30); the validation split is int(n * fraction)
    tokens, moved to a document start only within half of it; training windows start
    anywhere a window fits (12 tokens, 10: at 0 and 1)."""
    import numpy as np

    from phaseloop.data.corpus import Corpus, TrainBatches, eval_starts
    from phaseloop.data.store import TokenView
    from phaseloop.data.tokenizer import ByteTokenizer

    assert eval_starts(41, 10, 100).tolist() == [0, 10, 20, 30]

    def corpus(n, docs):
        return Corpus("x", "f", 1, n, ByteTokenizer(), TokenView([np.zeros(n, np.uint8)]), np.array(docs), {}, {})
    assert len(corpus(999, [0]).split(0.1)[1]) == 99  # int(99.9)
    assert len(corpus(1000, [0, 830]).split(0.1)[1]) == 100  # 830 is 70 from the cut at 900: not moved
    assert len(corpus(1000, [0, 870]).split(0.1)[1]) == 130  # 30 from it: the split starts there
    tb = TrainBatches(np.arange(12), seq_len=10, batch_size=256, seed=0)
    assert sorted(set(tb.next()[0][:, 0].tolist())) == [0, 1]
