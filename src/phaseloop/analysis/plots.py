"""Matplotlib in one place: the Agg backend, a clear error when it is missing, PNGs
written atomically (temporary file, then rename)."""

from __future__ import annotations

import io
from pathlib import Path

from phaseloop.errors import PhaseloopError
from phaseloop.files import atomic_write_bytes

MISSING = "matplotlib is not installed (pip install 'phaseloop[plot]')"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend; PhaseloopError when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PhaseloopError(f"plots need matplotlib: {MISSING}") from None
    return plt


def available() -> bool:
    try:
        pyplot()
        return True
    except PhaseloopError:
        return False


def save_png(fig, path: str | Path, dpi: int = 110) -> None:
    """Render ``fig`` to ``path`` (nothing half-written) and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(Path(path), buf.getvalue())
    pyplot().close(fig)


def finish(fig, ax, path: str | Path, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Label ``ax``, grid and legend it, then save ``fig`` to ``path`` (``save_png``)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    save_png(fig, path)


def plot_accuracy(per_seed: list[dict], path: str | Path, title: str) -> None:
    """Tasks: char and sequence accuracy against test length, one line per seed."""
    fig, axes = pyplot().subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, key, name in zip(axes, ("char_acc", "seq_acc"), ("character accuracy", "sequence accuracy")):
        for r in per_seed:
            Ls = sorted(r["per_length"])
            ax.plot(Ls, [r["per_length"][L][key] for L in Ls], "o-", label=f"seed {r['seed']}")
        ax.set_xlabel("test length")
        ax.set_title(name)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


def plot_depth_sweep(rows: list[dict], path: str | Path, title: str,
                     xlabel: str = "depth at inference (UT steps / loop passes)",
                     group: str | None = None, x: str = "depth") -> None:
    """eval --depth: loss and bits per byte against the trunk's depth at inference (or
    against the rows' ``x``: eval --kv-share's slots per looped layer); with ``group``
    (eval --exit: the rule), loss against each row's (mean) depth, one line per value of
    ``rows[i][group]``, the first row (no rule) a point every line starts from."""
    fig, ax = pyplot().subplots(figsize=(5, 3.2))
    if group is None:
        depths = [r[x] for r in rows]
        ax.plot(depths, [r["val_loss"] for r in rows], "o-", label="loss (nats/token)")
        ax.plot(depths, [r["val_bpb"] for r in rows], "s--", label="bits per byte")
    else:
        ref, rest = rows[0], rows[1:]
        for name in dict.fromkeys(r[group] for r in rest):
            line = sorted([ref] + [r for r in rest if r[group] == name], key=lambda r: r["depth"])
            ax.plot([r["depth"] for r in line], [r["val_loss"] for r in line], "o-", label=name)
        ax.set_ylabel("loss (nats/token)")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)
