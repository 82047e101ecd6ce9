"""``phaseloop serve``: a run (or an exported folder) behind an OpenAI-compatible API
(``phaseloop.serve``; docs/serve.md). The serve extra is imported when the command runs."""

from __future__ import annotations

import os
import sys

from phaseloop.cli import argtypes
from phaseloop.cli.options import depth_options, exit_options
from phaseloop.errors import PhaseloopError
from phaseloop.validation import MAX_SEQ_LEN

PORT_INT = argtypes.int_in(0, 65535, " (0: any free port)")


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve a run over an OpenAI-compatible API (completions, chat, "
                       "depth and exits per request)")
    p.add_argument("run", help="run folder (or its checkpoint folder) or a folder of `phaseloop export`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback; any other "
                   "is reachable from other machines: give --api-key)")
    p.add_argument("--port", type=PORT_INT, default=8000)
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health "
                   "(default: $PHASELOOP_API_KEY if set)")
    p.add_argument("--model-name", help="the model id clients name (default: the folder's name)")
    p.add_argument("--quantized", metavar="FILE", help="a quant-*.safetensors of `phaseloop quantize`: serve "
                   "a run with its packed int8/int4 weights on torch's CPU kernels (an export: dequantised)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for /v1/chat/completions "
                   "(default: the exported tokenizer's own, if any)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-prepack", action="store_true", help="run fp32 CPU Linears on F.linear without "
                   "oneDNN's prepacked copy of each weight: less memory, slower batches (docs/deploy.md)")
    depth_options(p)
    exit_options(p)
    p.add_argument("--max-batch", type=argtypes.positive_int, default=16,
                   help="sequences decoded together (1: one at a time, no batching)")
    p.add_argument("--max-queue", type=argtypes.positive_int, default=256,
                   help="sequences waiting for the batch; beyond it requests get 429")
    p.add_argument("--timeout", type=argtypes.positive_float, default=600.0,
                   help="seconds a request may take, waiting included (then 408)")
    p.add_argument("--max-context", type=argtypes.int_in(2, MAX_SEQ_LEN), help="prompt + max_tokens per sequence, in "
                   "tokens (default: the model's max_seq_len)")
    p.add_argument("--max-body-bytes", type=argtypes.positive_int, default=1 << 20,
                   help="largest request body (then 413)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from phaseloop.serve.loading import load
    from phaseloop.serve.options import Settings, check
    from phaseloop.serve.runner import Config, run
    from phaseloop.serve.schema import APIError

    if args.exit and len(args.exit) > 1:
        raise PhaseloopError(f"--exit {args.exit[0].kind}: give one value (a list sweeps in `phaseloop eval` only)")
    defaults = Settings(depth=args.depth, extend_loops=args.extend_loops, exit=args.exit[0] if args.exit else None)
    served = load(args.run, device=args.device, dtype=args.dtype, quantized=args.quantized, prepack=not args.no_prepack,
                  name=args.model_name, chat_template=args.chat_template, defaults=defaults)
    try:  # --depth / --exit the model cannot take: one line, before listening
        check(served.twin, served.defaults, flags=True)
    except APIError as e:  # a model that cannot be checked
        raise PhaseloopError(e.message.replace("phaseloop.", "--").replace("_", "-", 1)) from None
    limit = served.model.cfg.max_seq_len
    if args.max_context is not None and args.max_context > limit:  # as generate says of a long request
        print(f"note: --max-context {args.max_context} exceeds the model's max_seq_len {limit}: positions past "
              "it are beyond what it was trained on", file=sys.stderr)
    key = args.api_key if args.api_key is not None else os.environ.get("PHASELOOP_API_KEY") or None
    return run(served, Config(host=args.host, port=args.port, api_key=key, max_batch=args.max_batch,
                              max_queue=args.max_queue, timeout=args.timeout, max_context=args.max_context,
                              max_body_bytes=args.max_body_bytes))
