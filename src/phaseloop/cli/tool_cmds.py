"""``phaseloop tokenizer`` (train, encode, decode, stats) and ``phaseloop explore`` (the
local web app; its extra, and the tokenizers library, are imported when a command runs)."""

from __future__ import annotations

import json
import sys

from phaseloop.cli import argtypes
from phaseloop.cli.options import Parser
from phaseloop.data.corpus import load_corpus
from phaseloop.data.tokenizer import load_tokenizer
from phaseloop.data.tokenizer_train import train_tokenizer
from phaseloop.errors import PhaseloopError


def add_parsers(sub) -> None:
    """``phaseloop tokenizer``, ``explore``."""
    tok = sub.add_parser("tokenizer", help="train a BPE / word-level tokenizer; encode, decode, stats")
    actions = tok.add_subparsers(dest="action", required=True, parser_class=Parser)
    train = actions.add_parser("train", help="train on a data source, write DIR/tokenizer.json")
    train.add_argument("--data", default="stdlib", help="the data source (as train --data)")
    train.add_argument("--kind", choices=("bpe", "wordlevel"), default="bpe",
                       help="byte-level BPE, or a word-level vocabulary with [UNK]")
    train.add_argument("--vocab-size", type=argtypes.int_in(2), default=8192, help="tokens in the vocabulary")
    train.add_argument("--min-frequency", type=argtypes.nonneg_int,
                       help="bpe: the rarest pair merged (default 2); wordlevel: the rarest word kept (default 1)")
    train.add_argument("--out", help="folder to write tokenizer.json into")
    train.add_argument("--name", type=argtypes.safe_name,
                       help="keep it under this name ($PHASELOOP_CACHE/tokenizers/NAME)")
    for name, hlp in (("encode", "text -> token ids"), ("decode", "token ids -> text"),
                      ("stats", "tokens per byte of a data source")):
        action = actions.add_parser(name, help=hlp)
        action.add_argument("-t", "--tokenizer", default="bytes", help="bytes, a tokenizer.json, a folder or a name")
        if name == "stats":
            action.add_argument("--data", default="stdlib", help="the data source (as train --data)")
        else:
            action.add_argument("text", nargs="+", help="the text" if name == "encode" else "token ids")
    for action in (train, actions.choices["stats"]):
        action.add_argument("--text-column", default="text")
        action.add_argument("--data-split", default="train")
        action.add_argument("--streaming", action="store_true")
        action.add_argument("--quiet", action="store_true", help="no progress bar")
    tok.set_defaults(func=cmd_tokenizer)

    explore = sub.add_parser("explore", help="a local web app: the Learn pages, runs, inside a model "
                             "(needs the explore extra)")
    explore.add_argument("paths", nargs="*", metavar="RUN_OR_COMPARE_DIR", help="folders to serve (none: Learn only)")
    explore.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    explore.add_argument("--port", type=argtypes.int_in(0, 65535), default=0, help="0 or a taken port: a free one")
    explore.add_argument("--no-browser", action="store_true", help="print the URL only")
    explore.set_defaults(func=cmd_explore)


def cmd_tokenizer(args) -> int:
    """Train a tokenizer, encode / decode with one, or measure one on a data source."""
    if args.action == "train":

        tok = train_tokenizer(args.data, args.kind, args.vocab_size, args.out, args.name,
                              text_column=args.text_column, split=args.data_split, streaming=args.streaming,
                              min_frequency=args.min_frequency, progress=not args.quiet)
        print(f"wrote {tok.path} ({tok.kind}, {tok.vocab_size} tokens, sha256 {tok.sha256[:12]}...)")
        return 0
    tok = load_tokenizer(args.tokenizer)
    if args.action == "encode":
        print(" ".join(map(str, tok.encode(" ".join(args.text)).tolist())))
    elif args.action == "decode":
        try:
            ids = [int(t) for t in " ".join(args.text).replace(",", " ").split()]
        except ValueError:
            raise PhaseloopError("decode takes token ids, e.g. `phaseloop tokenizer decode -t T 12 40 7`") from None
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise PhaseloopError(f"token ids must lie in [0, {tok.vocab_size}) for this tokenizer")
        sys.stdout.write(tok.decode(ids) + "\n")
    else:  # stats
        c = load_corpus(args.data, tok, text_column=args.text_column, split=args.data_split,
                        streaming=args.streaming, progress=not args.quiet)
        d = c.describe()
        stats = {k: d[k] for k in ("source", "tokenizer", "tokenizer_kind", "tokenizer_vocab", "bytes",
                                   "tokens", "documents", "tokens_per_byte")}
        if tok.kind == "wordlevel" and "[UNK]" in tok.tok.get_vocab():
            unk = tok.tok.token_to_id("[UNK]")
            stats["unknown_fraction"] = float((c.tokens[:] == unk).mean())
        print(json.dumps(stats, indent=2))
    return 0


def cmd_explore(args) -> int:
    """Serve the explore web app until Ctrl-C (which ends it cleanly: exit 0)."""
    from phaseloop.explore.app import serve  # a missing explore extra: one line, exit 2

    try:
        return serve(args.paths, args.host, args.port, open_browser=not args.no_browser)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal
        print("phaseloop explore: stopped", file=sys.stderr)
        return 0
