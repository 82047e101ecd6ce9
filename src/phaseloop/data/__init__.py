"""Corpora and tokenizers: where text comes from (``sources``), how it is tokenised
(``tokenizer``, ``tokenizer_train``), kept on disk (``store``) and cut into training and
evaluation windows (``corpus``). Nothing here knows a model."""

from phaseloop.data.corpus import (
    Corpus,
    Documents,
    TrainBatches,
    corpus_args,
    eval_starts,
    eval_windows,
    load_corpus,
    separator_id,
)
from phaseloop.data.sources import SHAKESPEARE_SHA256, Source, resolve, stdlib_files

__all__ = ["Corpus", "Documents", "TrainBatches", "corpus_args", "eval_starts", "eval_windows", "load_corpus",
           "separator_id", "SHAKESPEARE_SHA256", "Source", "resolve", "stdlib_files"]
