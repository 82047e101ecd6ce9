"""Progress on stderr: a tqdm bar on a terminal; where stderr is not one (CI, nohup,
Slurm logs) no bar frames at all (tqdm's ``disable=None``), and the trainer prints one
line at each evaluation step instead (``eval_line``)."""

from __future__ import annotations


def bar(**kw):
    """A tqdm bar that is disabled (``.disable`` True) where stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, disable=None, **kw)


def eval_line(desc: str, step: int, steps: int, records: list[dict], evaluation: dict) -> str:
    """``DESC: step 200/1000, loss 2.3456, val_loss 2.4567, val_bpb 3.4567, 12345 tok/s``:
    the last training record's loss and speed, the evaluation's loss and bits per byte."""
    train = next((r for r in reversed(records) if "loss" in r), {})
    said = [f"{k} {evaluation[k]:.4f}" for k in ("val_loss", "val_bpb") if isinstance(evaluation.get(k), float)]
    return ", ".join([f"{desc}: step {step}/{steps}",
                      *([f"loss {train['loss']:.4f}"] if isinstance(train.get("loss"), float) else []), *said,
                      *([f"{train['tok_per_s']:.0f} tok/s"] if "tok_per_s" in train else [])])
