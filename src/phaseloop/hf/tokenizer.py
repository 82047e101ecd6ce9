"""A run's tokenizer as a ``transformers`` ``PreTrainedTokenizerFast``.

The byte tokenizer becomes a byte-level BPE with no merges whose vocabulary maps GPT-2's
printable stand-in of byte b to id b: it encodes any text to its UTF-8 bytes, exactly as
``ByteTokenizer``, and decodes invalid UTF-8 to U+FFFD, as ``ByteTokenizer.decode``.
A ``tokenizer.json`` (BPE, word-level, any fast tokenizer) is used as it is.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from phaseloop.data.tokenizer import ByteTokenizer, Tokenizer, byte_level_tokenizer


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The run's tokenizer for ``transformers`` / lm-eval. No special token is added to
    text (phaseloop trains on raw text, with no BOS or EOS)."""
    if isinstance(tok, ByteTokenizer):
        fast = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer())
    else:
        fast = PreTrainedTokenizerFast(tokenizer_file=str(tok.path))
    fast.model_max_length = int(1e30)  # the model config says how long a window can be
    return fast


def prefix_token_id(tok: Tokenizer, fast: PreTrainedTokenizerFast) -> int:
    """What lm-eval conditions a text with no context on (its first token, a rolling
    perplexity's first window): the tokenizer's EOS where it has one, else the token of
    a newline, which ends every document and line phaseloop trains on; else id 0."""
    if fast.eos_token_id is not None:
        return fast.eos_token_id
    ids = tok.encode("\n").tolist()
    return ids[0] if len(ids) == 1 else 0
