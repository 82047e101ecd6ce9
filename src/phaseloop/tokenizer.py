"""Tokenizers. Byte-level by default: vocab 256, any file works, and bits per byte is
exactly nats/token ÷ ln 2. A BPE tokenizer plugs in by implementing ``Tokenizer``."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .errors import ConfigError

# Special ids of the task vocabularies (tasks/) and the encoder-decoders (seq2seq.py): one
# convention everywhere. SEP separates a decoder-only task's prompt from its answer and is
# the encoder-decoder's BOS (the first decoder input).
PAD, EOS, SEP = 0, 1, 2
BOS = SEP


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def token_bytes(self) -> np.ndarray:
        """[vocab_size] number of UTF-8 bytes each token stands for (for bits per byte)."""
        ...


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)


TOKENIZERS = {"bytes": ByteTokenizer}


def get_tokenizer(name: str = "bytes") -> Tokenizer:
    if name not in TOKENIZERS:
        raise ConfigError(f"unknown tokenizer {name!r}; available: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()
