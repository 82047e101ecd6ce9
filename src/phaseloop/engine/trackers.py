"""Experiment trackers (``TrainConfig.log_to``, ``--log-to tensorboard,wandb``): the run's
metric records mirrored, as they are appended to metrics.jsonl (the record of truth), to
TensorBoard (event files through torch's ``SummaryWriter``, in RUN/tensorboard) and to
Weights & Biases (RUN/wandb; offline unless ``WANDB_MODE`` says otherwise). Only the
process that writes the run folder (rank 0 under torchrun) opens them.

A resumed run continues the same tracker runs without a duplicated step. TensorBoard: a
``purge_step`` one past the checkpoint, so readers drop what the interrupted process
logged after it (the resumed process logs those steps again). W&B: the same run id,
kept in RUN/trackers.json, and a record at a step that an earlier process of the run
already sent is not sent again (its history is append-only, and a resumed run is exact,
so that record holds the same values; timings aside)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import struct
import time
from pathlib import Path

from phaseloop.errors import CheckpointError, ConfigError, PhaseloopError, first_line
from phaseloop.files import atomic_write_bytes

EXTRA = "track"  # pyproject.toml's optional extra holding every tracker's package
IDS = "trackers.json"  # the run's tracker run ids (the W&B run id)


def names(log_to: str | None) -> list[str]:
    """The trackers of a ``log_to`` setting ("tensorboard,wandb"), checked by name."""
    out = [n.strip() for n in (log_to or "").split(",") if n.strip()]
    if log_to is not None and not out:  # "" or ",": a setting that names nothing
        raise ConfigError.invalid(f"log_to={log_to!r} names no tracker; name one or more of "
                                  f"{', '.join(TRACKERS)}, comma-separated, or leave it out", "train config")
    for n in out:
        if n not in TRACKERS:
            raise ConfigError.invalid(f"log_to={log_to!r}: unknown tracker {n!r}; choose "
                              f"from {', '.join(TRACKERS)}, comma-separated (e.g. --log-to tensorboard,wandb)",
                              "train config")
    if len(set(out)) < len(out):
        raise ConfigError.invalid(f"log_to={log_to!r}: a tracker is named twice; name each once", "train config")
    return out


def check(log_to: str | None, run_dir: Path | None = None) -> None:
    """Refuse, before anything is written, a tracker whose package is not installed, and
    a damaged ``trackers.json`` in ``run_dir`` that W&B would read."""
    for n in names(log_to):
        pkg = TRACKERS[n].package
        if importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"--log-to {n} needs the {pkg} package, which is not installed; "
                              f"pip install 'phaseloop[{EXTRA}]' (or pip install {pkg})")
    if run_dir is not None and "wandb" in names(log_to):
        read_ids(run_dir)


def scalars(record: dict) -> dict[str, float]:
    """A record's finite numbers but its step (booleans and strings are not metrics)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    package = "tensorboard"

    def __init__(self, run_dir: Path, step: int, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        logdir = run_dir / "tensorboard"
        # resumed: events at steps past the checkpoint (logged again now) are purged by readers
        self.writer = SummaryWriter(str(logdir), purge_step=step + 1 if logdir.exists() else None)

    def log(self, record: dict) -> None:
        for k, v in scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    package = "wandb"

    def __init__(self, run_dir: Path, step: int, config: dict):
        import wandb

        ids = read_ids(run_dir)
        if "wandb" not in ids:
            ids["wandb"] = secrets.token_hex(8)  # W&B run ids: lowercase letters and digits
            atomic_write_bytes(run_dir / IDS, (json.dumps(ids, indent=2) + "\n").encode())
        self.id = ids["wandb"]
        # steps an earlier process of this run sent (the history is append-only)
        self.sent = max((s for f in wandb_files(run_dir, self.id) for s, _ in wandb_history(f)), default=0)
        # W&B names a process's folder by the second it starts in (local time): a second
        # process of the run starting within that second would overwrite the first's log
        while any(p.name.rsplit("-", 2)[-2] == time.strftime("%Y%m%d_%H%M%S")
                  for p in (run_dir / "wandb").glob(f"*-{self.id}")):
            time.sleep(0.05)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                  x_save_requirements=False, disable_git=True,
                                  reinit="create_new")  # runs of one process (compare) each their own
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "phaseloop"), name=run_dir.name,
                              id=self.id, resume="allow", dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), settings=settings)

    def log(self, record: dict) -> None:
        if record["step"] > self.sent:
            self.run.log(scalars(record), step=record["step"])

    def flush(self) -> None:
        pass  # the W&B service writes as it receives

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}


class Trackers:
    """The trackers of one process of a run: ``log`` each record written to metrics.jsonl,
    ``flush`` before a checkpoint (what it covers is then on disk), ``close`` at the end."""

    def __init__(self, trackers: list | None = None):
        self.trackers = trackers or []

    @classmethod
    def open(cls, log_to: str | None, run_dir: Path, step: int, config: dict) -> Trackers:
        check(log_to)
        opened = []
        for n in names(log_to):
            try:
                opened.append(TRACKERS[n](Path(run_dir), step, config))
            except Exception as e:
                cls(opened).close()
                if isinstance(e, PhaseloopError):
                    raise
                raise PhaseloopError(f"--log-to {n}: the tracker could not start ({type(e).__name__}: "
                                     f"{first_line(e, 120) if str(e) else ''}); fix that (W&B: "
                                     "WANDB_MODE=offline needs no network) or drop it from --log-to") from None
        return cls(opened)

    def log(self, record: dict) -> None:
        for t in self.trackers:
            t.log(record)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close()


def read_ids(run_dir: Path) -> dict:
    path = Path(run_dir) / IDS
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise CheckpointError(f"{path} is damaged (it holds the run's tracker run ids); restore it, or delete "
                          "it to start new tracker runs")
    return ids


# ------------------------------------------------------------- reading W&B's run files back
# W&B 0.2x+ ships no Python reader of its transaction log (run-ID.wandb): LevelDB's log
# format (32 KiB blocks of records, each a 7-byte header: crc32, length, type), after a
# 7-byte file header, holding wandb_internal_pb2.Record messages.
_BLOCK, _HEADER, _FULL, _LAST = 32768, 7, 1, 4


def wandb_files(run_dir: Path, run_id: str) -> list[Path]:
    """The transaction logs of every process of W&B run ``run_id`` in a run folder, oldest first."""
    return sorted(Path(run_dir).glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))


def wandb_records(path: Path):
    """The Records of one .wandb file, in order; a record torn by a kill ends it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    pos, chunk = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if n == 0 and kind == 0 or pos + n > len(data):
            return
        chunk += data[pos:pos + n]
        pos += n
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            yield rec


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {metric: value}) of each history row of a .wandb file (W&B's own keys left out)."""
    rows = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            rows.append((rec.history.step.num, {k: v for k, v in row.items() if not k.startswith("_")}))
    return rows
