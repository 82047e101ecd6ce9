"""The 3PT plugin's own commands (``ArchSpec.commands``): ``phaseloop angles RUN`` (the
per-layer rotation-angle drift whose U-shaped profile the paper reports, §4) and
``phaseloop zero-sum RUN`` (the zero-sum diagnostic of the phase stripes, §2.5)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from phaseloop.analysis import plots
from phaseloop.analysis.probe import recording
from phaseloop.archs.three_phase import angle_drift, horn_zero_sum, zero_sum_diagnostic
from phaseloop.cli.argtypes import positive_int
from phaseloop.cli.options import on_a_run, png_path, run_seq_len, windows_of
from phaseloop.data.corpus import eval_windows
from phaseloop.engine.checkpoint import load_run, run_corpus, run_folder
from phaseloop.errors import PhaseloopError
from phaseloop.files import write_json


def add_commands(sub) -> None:
    a = on_a_run(sub, "angles", "3PT: per-layer rotation-angle drift of a run (+ PNG)", cmd_angles,
                 data=False, device=False)
    a.add_argument("--png", help="plot path (default RUN/angle_drift.png)")
    z = on_a_run(sub, "zero-sum", "3PT: zero-sum diagnostic of a run's residual stream", cmd_zero_sum,
                 windows=8, device=False)
    z.add_argument("--phases", type=positive_int, help="stripes to measure (default: the model's N)")


@torch.no_grad()
def zero_sum_profile(model: nn.Module, idx_BT: torch.Tensor, n: int | None = None) -> list[dict]:
    """The zero-sum diagnostic over ``n`` stripes (the model's N) at the embedding output and
    after every layer application the trunk makes (``Trunk.stream_sites``, via
    ``probe.recording``): a looped or UT block once per pass, a hyper-connection's n
    streams (their mean: the diagnostic is linear)."""
    n = n or model.cfg.n_phases
    with recording(model) as rec:
        model.eval()(idx_BT)
    return [{"site": site, "zero_sum": zero_sum_diagnostic(x if x.dim() == 3 else x.mean(2), n)}
            for site, x in rec.states]


def plot_angle_drift(rows: list[dict], path: str | Path) -> None:
    """|θ_final − θ_init| per rotation layer (``three_phase.angle_drift`` rows)."""
    fig, ax = plots.pyplot().subplots(figsize=(5, 3.2))
    ax.plot([r["layer"] for r in rows], [r["mean_abs_drift"] for r in rows], "o-", label="mean over pairs")
    ax.plot([r["layer"] for r in rows], [r["max_abs_drift"] for r in rows], "s--", alpha=0.6, label="max")
    ax.set_xlabel("layer")
    ax.set_ylabel("|θ_final − θ_init| (rad)")
    ax.set_title("3PT rotation-angle drift by depth")
    ax.legend()
    fig.tight_layout()
    plots.save_png(fig, path, dpi=120)


def cmd_angles(args) -> int:
    """3PT: per-layer |θ_final − θ_init| of a trained run, printed and plotted."""
    model, _ = load_run(args.run)
    rows = angle_drift(model)
    if not rows:
        raise PhaseloopError(f"{args.run} has no phase rotation (train with --preset 3pt-* "
                             "or --set phase_rotation=true)")
    print(f"{'layer':>5} {'theta_init':>10} {'mean|drift|':>12} {'max|drift|':>11}")
    for r in rows:
        print(f"{r['layer']:>5} {r['init']:>10.4f} {r['mean_abs_drift']:>12.5f} {r['max_abs_drift']:>11.5f}")
    run_dir = run_folder(args.run)  # a checkpoint given: its run's folder
    png = png_path("--png", args.png or run_dir / "angle_drift.png", "angle_drift.png")  # before writing anything
    write_json(run_dir / "angle_drift.json", rows)
    plot_angle_drift(rows, png)
    print(f"wrote {png} and {run_dir / 'angle_drift.json'}")
    return 0


def cmd_zero_sum(args) -> int:
    """3PT: Σ_i mean(stripe i) averaged over positions, at the embedding and each layer."""
    model, run_cfg = load_run(args.run)
    N, D = args.phases or model.cfg.n_phases, model.cfg.d_model
    if D % N:  # a measurement: only the stripes must tile d_model (the model is not rebuilt)
        raise PhaseloopError(f"--phases {N}: {N} stripes do not tile d_model={D}; use a divisor of {D}")
    corpus = run_corpus(args.run, run_cfg, args.data)
    seq_len = run_seq_len(args, run_cfg, model.cfg)
    _, val = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(val, seq_len, windows_of(args))[:, :-1]
    horn = f" (horn value N*H_T/T = {horn_zero_sum(N, seq_len):.4f})" if model.cfg.horn else " (no horn)"
    print(f"zero-sum diagnostic, N={N}, T={seq_len}{horn}")
    for r in zero_sum_profile(model, windows, N):
        print(f"  {r['site']:<18} {r['zero_sum']:+.5f}")
    return 0
