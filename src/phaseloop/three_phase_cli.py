"""The 3PT plugin's own commands (``ArchSpec.commands``): ``phaseloop angles RUN`` (the
per-layer rotation-angle drift whose U-shaped profile the paper reports, §4) and
``phaseloop zero-sum RUN`` (the zero-sum diagnostic of the phase stripes, §2.5)."""

from __future__ import annotations

from pathlib import Path

from . import plots
from .checkpoint import load_run, write_json
from .data import eval_windows, run_corpus
from .errors import PhaseloopError
from .three_phase import angle_drift, zero_sum_profile


def add_commands(sub) -> None:
    from .cli import on_a_run
    from .cli.argtypes import positive_int

    a = on_a_run(sub, "angles", "3PT: per-layer rotation-angle drift of a run (+ PNG)", cmd_angles,
                 data=False, device=False)
    a.add_argument("--png", help="plot path (default RUN/angle_drift.png)")
    z = on_a_run(sub, "zero-sum", "3PT: zero-sum diagnostic of a run's residual stream", cmd_zero_sum,
                 windows=8, device=False)
    z.add_argument("--phases", type=positive_int, help="stripes to measure (default: the model's N)")


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
    run_dir = Path(args.run)
    png = Path(args.png) if args.png else run_dir / "angle_drift.png"
    plots.pyplot()  # refuse before writing anything when matplotlib is missing
    write_json(run_dir / "angle_drift.json", rows)
    plots.plot_angle_drift(rows, png)
    print(f"wrote {png} and {run_dir / 'angle_drift.json'}")
    return 0


def cmd_zero_sum(args) -> int:
    """3PT: Σ_i mean(stripe i) averaged over positions, at the embedding and each layer."""
    model, run_cfg = load_run(args.run)
    if args.phases:
        model.cfg = model.cfg.replace(n_phases=args.phases)
    corpus = run_corpus(args.run, run_cfg, args.data)
    seq_len = args.seq_len or model.cfg.max_seq_len
    _, val = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(val, seq_len, args.windows)[:, :-1]
    N, T = model.cfg.n_phases, seq_len
    expect = N * sum(1 / k for k in range(1, T + 1)) / T
    print(f"zero-sum diagnostic, N={N}, T={T} (horn value N*H_T/T = {expect:.4f})")
    for r in zero_sum_profile(model, windows):
        print(f"  {r['site']:<18} {r['zero_sum']:+.5f}")
    return 0
