"""A run folder: what was run (config.json), what happened (metrics.jsonl), where it got
to (checkpoint/) and how it ended (summary.json). Every write is a temporary file or
folder renamed into place; a folder holding another run is never touched."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import checkpoint_dir, read_json, write_json
from ..files import atomic_write_bytes
from ..errors import CheckpointError

# keys that may change between a run and its resumption (where it runs, not what)
RESUMABLE_CHANGES = ("device", "compile")


def _first_difference(saved: dict, want: dict, section: str) -> str | None:
    if section == "data":  # the same bytes and the same tokenizer, however they were named
        keys = ("fingerprint", "tokenizer_sha256")
        return next((k for k in keys if saved.get(k) != want.get(k) and (k in saved or want.get(k))), None)
    keys = sorted(set(saved) | set(want), key=str)
    return next((k for k in keys if saved.get(k) != want.get(k) and k not in RESUMABLE_CHANGES), None)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (none if it has none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class RunFolder:
    """The folder of one training run. ``open`` checks it before anything is written:
    a new run needs an absent or empty folder; ``resume=True`` needs the same settings
    (every section of ``run_cfg`` but ``software``); ``start`` then writes config.json
    (new runs) and drops metric records past the step resumed from."""

    def __init__(self, path: str | Path, run_cfg: dict, resuming: bool):
        self.path, self.run_cfg, self.resuming = Path(path), run_cfg, resuming

    @classmethod
    def open(cls, path: str | Path, run_cfg: dict, resume: bool = False) -> "RunFolder":
        path = Path(path)
        if (path / "config.json").exists():
            if not resume:
                raise CheckpointError(f"{path} already holds a run; pass --resume to continue it "
                                      "or choose another --out")
            saved = read_json(path / "config.json")
            for section, want in run_cfg.items():
                if section == "software":
                    continue
                k = _first_difference(saved.get(section, {}), want, section)
                if k is None:
                    continue
                if section == "data" and k == "tokenizer_sha256":
                    raise CheckpointError(f"{path} was trained with another tokenizer "
                                          f"({saved['data'].get('tokenizer')!r}, sha256 "
                                          f"{str(saved['data'].get(k))[:12]}...); resume with the same "
                                          "--tokenizer or choose another --out")
                if section == "data":
                    raise CheckpointError(f"{path} was trained on other data ({saved.get('data', {}).get('source')}); "
                                          "resume with the same --data or choose another --out")
                raise CheckpointError(
                    f"{path} holds a run with a different {section} config ({k}: "
                    f"{saved.get(section, {}).get(k)!r} there, {want.get(k)!r} now); "
                    "resume with the same settings or choose another --out")
        elif resume:
            raise CheckpointError(f"{path} holds no run to resume; drop --resume to start one")
        elif path.exists() and any(path.iterdir()):
            raise CheckpointError(f"{path} exists and is not empty; choose another --out")
        return cls(path, run_cfg, resume)

    @property
    def checkpoint(self) -> Path | None:
        return checkpoint_dir(self.path) if self.resuming else None

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def start(self, step: int) -> None:
        """Create the folder, keep the metric records up to ``step``, write config.json."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.metrics_path.exists():  # records after the checkpoint are logged again
            keep = [line for line in self.metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= step]
            atomic_write_bytes(self.metrics_path, ("\n".join(keep) + "\n" if keep else "").encode())
        if not (self.path / "config.json").exists():
            write_json(self.path / "config.json", self.run_cfg)

    def log(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def finish(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary)
