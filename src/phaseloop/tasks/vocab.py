"""The character vocabulary of the algorithmic tasks (``algorithmic.py``); JSONL tasks
use a tokenizer's (``jsonl.TokenizerVocab``), bAbI a word vocabulary (``babi.WordVocab``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from phaseloop.data.tokenizer import EOS, PAD, SEP
from phaseloop.errors import ConfigError
from phaseloop.tasks.algorithmic import DIGITS, Example


class CharVocab:
    """Character vocabulary for the algorithmic tasks.

    Special ids (fixed): ``PAD = 0`` (padding; ignored by ``decode``), ``EOS = 1`` (end
    of sequence; ``decode`` stops there), ``SEP = 2`` (separates input from target when
    both go to one decoder-only sequence). Symbols follow from id 3 in the order given;
    the default symbols ``"0123456789+"`` cover all four tasks with the default
    alphabets (parity uses ``'0'``/``'1'``, addition digits and ``'+'``). Pass other
    symbols for copy/reverse with a custom alphabet.
    """

    PAD, EOS, SEP = PAD, EOS, SEP  # phaseloop.data.tokenizer: one convention everywhere
    SPECIALS = ("<pad>", "<eos>", "<sep>")
    DEFAULT_SYMBOLS = DIGITS + "+"

    def __init__(self, symbols: str = DEFAULT_SYMBOLS) -> None:
        if not isinstance(symbols, str) or not symbols:
            raise ConfigError(f"CharVocab symbols must be a non-empty string, got {symbols!r}")
        if len(set(symbols)) != len(symbols):
            raise ConfigError(f"CharVocab symbols {symbols!r} repeat a character; list each once")
        self.symbols = symbols
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(symbols)}

    pad_id = property(lambda self: self.PAD)
    eos_id = property(lambda self: self.EOS)
    sep_id = property(lambda self: self.SEP)

    @classmethod
    def for_examples(cls, examples: Iterable[Example]) -> CharVocab:
        """A vocab of the sorted characters that occur in the examples."""
        chars = sorted({c for ex in examples for c in ex.input + ex.target})
        return cls("".join(chars))

    def __len__(self) -> int:
        return len(self.SPECIALS) + len(self.symbols)

    @property
    def size(self) -> int:
        return len(self)

    def __repr__(self) -> str:
        return f"CharVocab({self.symbols!r})"

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the vocabulary {self.symbols!r}; "
                "build CharVocab with it (e.g. CharVocab.for_examples)"
            ) from None
        if add_eos:
            ids.append(self.EOS)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor, stop_at_eos: bool = True) -> str:
        """Ids to text: PAD and SEP are dropped; decoding stops at the first EOS
        (or EOS is dropped too, with ``stop_at_eos=False``). Unknown ids raise."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        nspec = len(self.SPECIALS)
        for i in ids:
            i = int(i)
            if i == self.EOS and stop_at_eos:
                break
            if i < nspec and i >= 0:
                continue
            j = i - nspec
            if not 0 <= j < len(self.symbols):
                raise ValueError(f"id {i} is outside the vocabulary (size {len(self)})")
            out.append(self.symbols[j])
        return "".join(out)
