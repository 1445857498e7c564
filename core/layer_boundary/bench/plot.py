"""Optional PNG plots of benchmark tables (skipped, with a note, when matplotlib is absent)."""

from __future__ import annotations

from pathlib import Path


def line_plot(path: str, title: str, x_label: str, y_label: str, series: dict, *, log_x: bool = True) -> str:
    """Write a PNG with one line per series {name: (xs, ys)}; returns a note for the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"(no PNG: matplotlib is not installed; {path} not written)"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
