"""Training a tokenizer on any data source with the ``tokenizers`` library (``phaseloop
tokenizer train``):

* ``bpe``: byte-level BPE as GPT-2 / Llama-3 use it (ByteLevel pre-tokenizer and decoder,
  the 256-byte alphabet in the vocabulary from the start, so no byte is ever unknown);
* ``wordlevel``: one token per whitespace-separated word, the ``vocab_size - 1`` most
  frequent, and ``[UNK]`` for the rest (the 3PT paper's 10,000-word setting).
"""

from __future__ import annotations

from pathlib import Path

from phaseloop.data.sources import resolve
from phaseloop.data.tokenizer import FILE, HFTokenizer, registry
from phaseloop.errors import ConfigError, DataError
from phaseloop.files import atomic_write_bytes, check_name
from phaseloop.validation import MAX_INT

KINDS = ("bpe", "wordlevel")
UNK = "[UNK]"


def _texts(source):
    for doc in source.documents(split_anywhere=False):
        for piece in doc:
            yield piece.decode("utf-8", errors="replace")


def train_tokenizer(data: str, kind: str, vocab_size: int, out: str | Path | None = None,
                    name: str | None = None, *, text_column: str = "text", split: str = "train",
                    streaming: bool = False, min_frequency: int | None = None, progress: bool = True) -> HFTokenizer:
    """Train on ``data`` and write ``<out>/tokenizer.json`` (or the registry's ``<name>/``);
    an existing tokenizer there is never overwritten. ``min_frequency``: BPE's rarest pair
    merged (None: 2), a word-level vocabulary's rarest word kept (None: 1)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError("training a tokenizer needs the tokenizers library: pip install 'phaseloop[data]'") from None
    if kind not in KINDS:
        raise ConfigError(f"unknown tokenizer kind {kind!r}; choose {' or '.join(KINDS)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 2 <= vocab_size <= MAX_INT:
        raise ConfigError(f"--vocab-size {vocab_size!r}: must be an integer from 2 to {MAX_INT}")
    if min_frequency is None:
        min_frequency = 2 if kind == "bpe" else 1
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or not 0 <= min_frequency <= MAX_INT:
        raise ConfigError(f"--min-frequency {min_frequency!r}: must be an integer from 0 to {MAX_INT} "
                          "(the fewest occurrences of a pair merged (bpe, default 2) or a word kept (wordlevel, "
                          "default 1))")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "bpe" and vocab_size < len(alphabet):
        raise ConfigError(f"--vocab-size {vocab_size} is below the byte alphabet ({len(alphabet)} tokens) "
                          f"of a byte-level BPE; use >= {len(alphabet)} (or --kind wordlevel)")
    if (out is None) == (name is None):
        raise ConfigError("give exactly one of --out DIR and --name NAME")
    if name == "bytes":
        raise ConfigError("--name bytes is the built-in byte tokenizer's name (-t bytes); choose another")
    folder = Path(out) if out is not None else registry() / check_name(name)
    if (folder / FILE).exists():
        raise ConfigError(f"{folder / FILE} exists; choose another --out/--name (nothing is overwritten)")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {folder} is a file; pass a folder")
    source = resolve(data, text_column, split, streaming)

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      initial_alphabet=alphabet, show_progress=progress, special_tokens=[])
    else:
        tok = Tokenizer(models.WordLevel(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            show_progress=progress, special_tokens=[UNK])
    tok.train_from_iterator(_texts(source), trainer)
    if tok.get_vocab_size() <= (1 if kind == "wordlevel" else 0):
        raise DataError(f"data {data!r} gave an empty vocabulary; pass more text")
    atomic_write_bytes(folder / FILE, tok.to_str(pretty=True).encode())
    return HFTokenizer(folder / FILE)
