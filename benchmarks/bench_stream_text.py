"""The text of a served sequence, token by token (serve.sequence, docs/serve.md): what
``Sequence.push`` costs a token when a stream or a stop string needs the text so far,
decoding every token again (the plain ``decode``) against ``Vocab.running`` (a byte-level
vocabulary's new bytes only), at a few lengths, side by side in one process and
alternated round by round (medians). Tokens are random ids; the vocabularies: the byte
tokenizer and a byte-level BPE of --vocab tokens trained on --data (the built-in corpus
without one).

    python benchmarks/bench_stream_text.py [--lengths 256,1024,4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.data.tokenizer_train import train_tokenizer
from phaseloop.serve.options import Settings
from phaseloop.serve.responses import Vocab
from phaseloop.serve.sequence import Sampling, Sequence


def pushes(decode, ids: list[int]) -> float:
    """Seconds to push ``ids`` into a streamed sequence with a stop string that never occurs."""
    s = Sequence([0], len(ids) + 1, Sampling(temperature=0), Settings(), decode, lambda ev: None,
                 stop=["\x00\x01never"], stream=True)
    t0 = time.perf_counter()
    for t in ids:
        s.push(t, None)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--vocab", type=int, default=1024)
    a = p.parse_args(argv)
    byte = ByteTokenizer()
    bpe = train_tokenizer(a.data, "bpe", a.vocab, tempfile.mkdtemp(), progress=False)
    vocabs = {"bytes": (Vocab(byte.decode, byte.token_bytes, True), 256),
              f"bpe-{a.vocab}": (Vocab(bpe.decode, bpe.token_bytes, bpe.byte_level), bpe.vocab_size)}
    print("| vocabulary | tokens | every token again (us a token) | running (us a token) | ratio |")
    print("|---|---|---|---|---|")
    for name, (vocab, V) in vocabs.items():
        for n in (int(x) for x in a.lengths.split(",")):
            ids = [random.Random(n).randrange(V) for _ in range(n)]
            again, running = [], []
            for r in range(a.rounds):
                for which in ((0, 1) if r % 2 else (1, 0)):
                    secs = pushes(vocab.decode if which == 0 else vocab, ids)  # plain decode: no ``running``
                    (again if which == 0 else running).append(secs / n)
            g, f = statistics.median(again), statistics.median(running)
            print(f"| {name} | {n} | {g * 1e6:.1f} | {f * 1e6:.1f} | {g / f:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
