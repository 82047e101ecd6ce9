"""Run folders for the serve tests without training them: a preset's model with its weights
moved off their init (a zero-init path would hide bugs), saved as `phaseloop train` saves a
run (config.json + a verified checkpoint), so every command reads it as a trained run."""

from pathlib import Path

import torch

from phaseloop import ModelConfig, build_model
from phaseloop.engine.checkpoint import save_checkpoint
from phaseloop.engine.config import TrainConfig
from phaseloop.files import write_json


def fake_run(root: Path, preset: str, scale: float = 0.1, **over) -> Path:
    """A run folder ``root / preset`` holding ``preset``'s model (``over``: config fields)."""
    cfg = ModelConfig.from_preset(preset, **over)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    run = Path(root) / preset
    run.mkdir(parents=True)
    config = {"model": cfg.to_dict(), "train": TrainConfig(steps=1).to_dict(), "data": {"tokenizer": "bytes"}}
    write_json(run / "config.json", config)
    save_checkpoint(run, model, step=1, config=config)
    return run
