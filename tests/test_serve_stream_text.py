"""A served sequence's text, token by token (serve.responses.Vocab.running): for a
byte-level vocabulary the running decode equals decoding every prefix again, special
tokens and bytes of unfinished characters included, and a Sequence's events (streamed
deltas, stop strings, the final text) are those of decoding every prefix; the tokens are
then decoded once, at the end, not once a token."""

from __future__ import annotations

import random

import pytest

from phaseloop.data.tokenizer import ByteTokenizer, HFTokenizer
from phaseloop.serve.options import Settings
from phaseloop.serve.responses import Vocab
from phaseloop.serve.sequence import Sampling, Sequence

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A 300-token byte-level BPE with one special token (an export's EOS)."""
    from phaseloop.data.tokenizer_train import train_tokenizer

    d = tmp_path_factory.mktemp("bpe")
    text = d / "t.txt"
    text.write_text("naïve café — ünïcödé ✓ 東京 the cat sat on the mat\n" * 50, encoding="utf-8")
    tok = train_tokenizer(str(text), "bpe", 300, d / "tok", progress=False)
    raw = tokenizers.Tokenizer.from_file(str(tok.path))
    raw.add_special_tokens(["<|endoftext|>"])
    raw.save(str(tok.path))
    return HFTokenizer(tok.path)


def _ids(vocab_size: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def _vocabs(bpe):
    from transformers import PreTrainedTokenizerFast

    byte = ByteTokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_file=str(bpe.path))  # an export's decode (serve.loading)
    return {"bytes": (Vocab(byte.decode, byte.token_bytes, True), 256),
            "bpe": (Vocab(bpe.decode, bpe.token_bytes, bpe.byte_level), bpe.vocab_size),
            "bpe-export": (Vocab(fast.decode, bpe.token_bytes, bpe.byte_level), bpe.vocab_size)}


def test_running_decode_equals_decoding_every_prefix(bpe):
    for name, (vocab, V) in _vocabs(bpe).items():
        assert vocab.byte_level
        for seed in range(4):
            ids = _ids(V, 120, seed)
            feed = vocab.running()
            for i, t in enumerate(ids):
                assert feed(t) == vocab(ids[:i + 1]), (name, seed, i)


def test_running_decode_of_unfinished_characters():
    byte = ByteTokenizer()
    feed = Vocab(byte.decode, byte.token_bytes, True).running()
    euro = list("€".encode())  # 3 bytes
    assert [feed(b) for b in euro] == ["\ufffd", "\ufffd", "€"]
    assert feed(0xE2) == "€\ufffd" and feed(ord("A")) == "€\ufffdA"  # a character cut short: one U+FFFD
    assert Vocab(byte.decode, byte.token_bytes, False).running() is None  # another vocabulary: none


class Counting:
    """``vocab`` with its full decodes counted (``plain``: without ``running``)."""

    def __init__(self, vocab: Vocab, plain: bool):
        self.vocab, self.calls = vocab, 0
        if not plain:
            self.running = vocab.running

    def __call__(self, ids):
        self.calls += 1
        return self.vocab(ids)


def _run(decode, ids, stop, stream, max_new):
    events = []
    s = Sequence([1], max_new, Sampling(temperature=0), Settings(), decode, events.append, stop=stop,
                 stream=stream)
    for t in ids:
        if s.finish is not None:
            break
        s.push(t, None)
    return s, [(e.text, e.token, e.finish) for e in events]


def test_sequence_events_equal_decoding_every_prefix(bpe):
    for name, (vocab, V) in _vocabs(bpe).items():
        for seed in range(6):
            ids = _ids(V, 80, seed)
            text = vocab(ids)
            stop = [text[40:43]] if seed % 2 else []  # a stop string that occurs (or none)
            for stream in (True, False):
                plain, fast = Counting(vocab, True), Counting(vocab, False)
                a, ev_a = _run(plain, ids, stop, stream, 80)
                b, ev_b = _run(fast, ids, stop, stream, 80)
                assert (b.text, b.finish, b.tokens, ev_b) == (a.text, a.finish, a.tokens, ev_a), (name, seed, stream)
                if stream:  # the deltas add up to the text
                    assert "".join(e[0] for e in ev_b) == b.text
                if stop:
                    assert b.finish == "stop" and len(b.tokens) < 80
                assert fast.calls <= 1  # the final text only
                assert plain.calls >= len(a.tokens) if stream or stop else plain.calls <= 1


def test_a_stop_string_waits_for_unfinished_characters():
    """The bytes of "€" decode as U+FFFD until the last one: a stop string holding U+FFFD
    must not end the sequence there; an invalid byte (a U+FFFD that stays) still stops it."""
    byte = ByteTokenizer()
    vocab = Vocab(byte.decode, byte.token_bytes, True)
    for decode in (vocab, Counting(vocab, False)):
        s, _ = _run(decode, [*"a€b".encode()], ["\ufffd"], False, 5)
        assert (s.text, s.finish, len(s.tokens)) == ("a€b", "length", 5)
        s, _ = _run(decode, [*b"a\xffbcd"], ["\ufffd"], True, 10)
        assert (s.text, s.finish, s.tokens) == ("a", "stop", [*b"a\xffb"])
        s, _ = _run(decode, [*b"a\xff"], ["\ufffd"], False, 2)  # at the end: cut, though no token followed
        assert (s.text, s.finish) == ("a", "length")
