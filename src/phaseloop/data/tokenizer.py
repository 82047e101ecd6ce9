"""Tokenizers: bytes (built in, vocab 256) or any Hugging Face fast tokenizer
(``tokenizer.json``, through the ``tokenizers`` library: the ``data`` extra).

``load_tokenizer(spec)``: ``"bytes"`` | a path to a ``tokenizer.json`` | a folder holding
one | the name of one trained with ``phaseloop tokenizer train --name NAME`` (kept under
``$PHASELOOP_CACHE/tokenizers/NAME/``). Every tokenizer knows how many UTF-8 bytes a
window of its tokens decodes to (``window_bytes``), so bits per byte is exact for any of
them: exactly one byte per token for ``bytes``, the bytes of each token for byte-level
BPE (GPT-2's byte alphabet), the decoded text otherwise (a word-level tokenizer's decode
joins words with spaces; its unknown token counts as ``[UNK]``).
"""

from __future__ import annotations

import json
import os
import re
from functools import cache, cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from phaseloop.errors import ConfigError, DataError, first_line
from phaseloop.files import cache_dir, sha256_file, why_missing

# Special ids of the task vocabularies (tasks/) and the encoder-decoders (seq2seq.py): one
# convention everywhere. SEP separates a decoder-only task's prompt from its answer and is
# the encoder-decoder's BOS (the first decoder input).
PAD, EOS, SEP = 0, 1, 2
BOS = SEP

FILE = "tokenizer.json"
# Where long UTF-8 text may be cut for a chunk-safe tokenizer (zero-width, over bytes):
# before a newline that precedes a non-space character, or after a newline followed by one
# space and a non-space (WikiText's lines). GPT-2's pre-tokenizer splits a whitespace run
# before its last character when a non-space follows, so these cuts fall on pre-token
# boundaries. A non-space is an ASCII one or a character whose lead byte starts no Unicode
# space (not \xc2: U+0085, U+00A0; \xe1: U+1680; \xe2: U+2000-U+205F; \xe3: U+3000), which
# the pre-tokenizer joins to the newline before it.
_SOLID = rb"[!-~\xc3-\xe0\xe4-\xf4]"
CUT_PATTERN = rb"(?=\n" + _SOLID + rb")|(?<=\n)(?= " + _SOLID + rb")"


class Tokenizer(Protocol):
    name: str  # "bytes", or the file's folder name
    kind: str  # bytes | bpe | wordlevel | other
    vocab_size: int
    sha256: str | None  # of the tokenizer file (None for bytes)
    path: Path | None
    chunk_safe: bool  # encoding text pieces split after a newline = encoding the whole
    byte_level: bool  # decoding = the tokens' bytes joined (token_bytes), then UTF-8

    def encode(self, data: bytes | str) -> np.ndarray: ...

    def encode_batch(self, pieces: list[bytes | str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...

    def token_bytes(self, i: int) -> bytes: ...

    def window_bytes(self, ids_NT) -> np.ndarray: ...


def _not_utf8(text: str) -> DataError:
    """The error for text holding bytes that are not UTF-8 (Python keeps such bytes of a
    command-line argument as lone surrogates)."""
    i = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    b = text[i].encode("utf-8", "surrogateescape")
    byte = f"byte 0x{b[0]:02x}" if len(b) == 1 else "a lone surrogate"
    return DataError(f"the text is not UTF-8 ({byte} at character {i}: {text[max(0, i - 12):i]!r} "
                     f"before it); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)")


def utf8_text(data: bytes | str) -> str:
    """Text for a tokenizer that reads Unicode: bytes are decoded as UTF-8 (bytes that are
    not UTF-8 become U+FFFD, as a corpus is read); a string holding non-UTF-8 bytes (a
    command-line argument in another encoding) is refused, naming the byte."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise _not_utf8(data) from None
        return data
    return bytes(data).decode("utf-8", errors="replace")


class ByteTokenizer:
    """Token = byte: any file works, nothing is unknown, BPB = nats/token / ln 2."""

    name = kind = "bytes"
    vocab_size = 256
    sha256 = path = unk_id = None
    chunk_safe = byte_level = True

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            try:
                data = data.encode("utf-8")
            except UnicodeEncodeError:
                raise _not_utf8(data) from None
        return np.frombuffer(data, dtype=np.uint8).copy()

    def encode_batch(self, pieces):
        return [self.encode(p) for p in pieces]

    def decode(self, ids) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (one byte, which may be part of a character)."""
        return bytes([int(i) & 0xFF])

    def window_bytes(self, ids_NT) -> np.ndarray:
        return np.full(len(ids_NT), np.shape(ids_NT)[1], dtype=np.int64)


@cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character standing for each byte
    (made once; callers read it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}



def byte_level_tokenizer():
    """``tokenizers.Tokenizer`` equal to ``ByteTokenizer``: id = byte value (a byte-level
    BPE with no merges over GPT-2's printable stand-ins of the bytes), for the tools that
    read a tokenizer.json (transformers, ExecuTorch's runner)."""
    try:
        from tokenizers import Tokenizer as _T
        from tokenizers import decoders, models, pre_tokenizers
    except ImportError:
        raise ConfigError("a tokenizer.json for the byte tokenizer needs the tokenizers library: "
                          "pip install 'phaseloop[data]'") from None
    tok = _T(models.BPE(vocab=dict(_gpt2_byte_decoder()), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok

class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from a tokenizer.json. Corpus text is encoded
    without special tokens (no BOS/EOS added); bytes that are not UTF-8 become U+FFFD."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _T
        except ImportError:
            raise ConfigError("tokenizer files need the tokenizers library: pip install "
                              "'phaseloop[data]'") from None
        self.path = Path(path)
        try:
            self.tok = _T.from_file(str(self.path))
        except Exception as e:  # not JSON, or JSON that is not a tokenizer
            raise ConfigError(f"{self.path} is not a tokenizer file ({first_line(e, 80)}); "
                              "pass a tokenizer.json made by `phaseloop tokenizer train` or a "
                              "Hugging Face fast tokenizer") from None
        self.sha256 = sha256_file(self.path)
        self.name = self.path.parent.name or self.path.stem
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        spec = json.loads(self.path.read_text())
        self._pre = (spec.get("pre_tokenizer") or {}).get("type")
        self._dec = (spec.get("decoder") or {}).get("type")
        model = (spec.get("model") or {}).get("type")
        self.kind = {"BPE": "bpe", "WordLevel": "wordlevel"}.get(model, "other")
        if self.kind == "bpe" and self._pre != "ByteLevel":
            self.kind = "other"
        if self.vocab_size == 0:
            raise ConfigError(f"{self.path} has an empty vocabulary (0 tokens), so no text can be "
                              "encoded; pass a trained tokenizer (`phaseloop tokenizer train`)")
        unk = (spec.get("model") or {}).get("unk_token")
        self.unk_id = self.tok.token_to_id(unk) if isinstance(unk, str) else None  # what a word outside it becomes
        self._no_unk = model == "WordLevel" and self.unk_id is None

    @cached_property
    def chunk_safe(self) -> bool:
        """Whether text cut at ``CUT_PATTERN`` encodes to the tokens of the whole (true for
        byte-level BPE and whitespace pre-tokenizers; a leading-space scheme such as
        Metaspace fails the probe and then gets whole documents)."""
        probe = ["First line\nsecond  one\n\n third\nx\n = T = \n \n The end", "a\nb\n'c\n-d\n\te\n\ng",
                 "e\n\n\ng\n \n x  \n\tz\n 's\n'q x\n  \n  w",
                 "é . \n\u00a0n\n\u3000i\n\u0085e\n 東京\nü\n\u2003x\n\u2009 y"]
        for text in probe:
            raw = text.encode()
            cuts = [m.start() for m in re.finditer(CUT_PATTERN, raw) if m.start()]
            parts = [raw[a:b].decode() for a, b in zip([0] + cuts, cuts + [len(raw)])]
            try:
                if np.concatenate(self.encode_batch(parts)).tolist() != self.encode(text).tolist():
                    return False
            except DataError:  # cannot encode the probe (a WordLevel without [UNK]): whole documents
                return False
        return True

    _text = staticmethod(utf8_text)

    def _cannot(self, e: Exception, texts: list[str]) -> DataError:
        """The library refused to encode (a foreign tokenizer: a WordLevel vocabulary without
        an unknown token meets a word outside it, ...): one error naming the word and the fix."""
        why = first_line(e, 100)
        if self._no_unk:
            vocab = self.tok.get_vocab(with_added_tokens=True)
            pre = self.tok.pre_tokenizer
            for t in texts:
                words = [w for w, _ in pre.pre_tokenize_str(t)] if pre is not None else t.split()
                word = next((w for w in words if w not in vocab), None)
                if word is not None:
                    return DataError(f"tokenizer {self.path} cannot encode the word {word[:40]!r}: its "
                                     "WordLevel vocabulary has no unknown token for words outside it; "
                                     "add an unk_token to the file, or train one with `phaseloop "
                                     "tokenizer train --kind wordlevel` (which has [UNK])")
        return DataError(f"tokenizer {self.path} cannot encode this text ({why}); use a tokenizer "
                         "that covers it, e.g. a byte-level BPE from `phaseloop tokenizer train`")

    def encode(self, data: bytes | str) -> np.ndarray:
        text = self._text(data)
        try:
            ids = self.tok.encode(text, add_special_tokens=False).ids
        except Exception as e:  # the library's own error type
            raise self._cannot(e, [text]) from None
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, pieces):
        """Encoded in parallel over the cores by the library (without offsets, which a
        corpus never needs, where the library offers that)."""
        fn = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        texts = [self._text(p) for p in pieces]
        try:
            encs = fn(texts, add_special_tokens=False)
        except Exception as e:
            raise self._cannot(e, texts) from None
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for: a byte-level piece mapped back to its bytes (part
        of a character, maybe), a byte-fallback ``<0xNN>`` its byte, else its decoded text."""
        piece = self.tok.id_to_token(int(i))
        if piece is not None and self._dec == "ByteLevel" and piece not in self._special:
            dec = _gpt2_byte_decoder()
            if all(c in dec for c in piece):
                return bytes(dec[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([i]).encode("utf-8")

    @property
    def byte_level(self) -> bool:
        return self._dec == "ByteLevel"

    @cached_property
    def _special(self) -> set:
        return {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}

    @cached_property
    def _token_bytes(self) -> np.ndarray | None:
        """Bytes per token for byte-level tokenizers (exact), else None."""
        if self._dec != "ByteLevel":
            return None
        dec = _gpt2_byte_decoder()
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            if token not in self._special:
                out[i] = sum(1 if c in dec else len(c.encode()) for c in token)
        return out

    def window_bytes(self, ids_NT) -> np.ndarray:
        ids = np.asarray(ids_NT)
        if self._token_bytes is not None:
            return self._token_bytes[ids].sum(axis=1)
        return np.array([len(self.decode(row).encode("utf-8")) for row in ids], dtype=np.int64)


def registry() -> Path:
    """Where ``phaseloop tokenizer train --name NAME`` keeps named tokenizers."""
    return cache_dir() / "tokenizers"


def load_tokenizer(spec: str | os.PathLike | Tokenizer = "bytes") -> Tokenizer:
    """``bytes`` | tokenizer.json | a folder holding one | a name in the registry."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = str(spec)
    if spec == "bytes":
        return ByteTokenizer()
    p = Path(spec).expanduser()
    for cand in (p, p / FILE, registry() / spec / FILE):
        if cand.is_file():
            return HFTokenizer(cand)
    if p.is_symlink() and not p.exists():
        raise ConfigError(f"tokenizer {spec!r} {why_missing(p)}; point --tokenizer at a tokenizer.json")
    named = sorted(f.parent.name for f in registry().glob(f"*/{FILE}"))
    raise ConfigError(f"unknown tokenizer {spec!r}: not 'bytes', a tokenizer.json, a folder holding one, "
                      f"or a trained name ({', '.join(named) or 'none trained yet'}); train one with "
                      "`phaseloop tokenizer train`")


get_tokenizer = load_tokenizer


def describe(tok: Tokenizer) -> dict:
    return {"tokenizer": tok.name, "tokenizer_kind": tok.kind, "tokenizer_sha256": tok.sha256,
            "tokenizer_vocab": tok.vocab_size}
