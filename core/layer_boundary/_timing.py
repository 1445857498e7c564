"""What every benchmark (the core's and the plugins') measures and draws with: CUDA-event timing
of a call and optional PNG plots of its tables (skipped, with a note, without matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

__all__ = ["cuda_event_us", "line_plot"]


def cuda_event_us(fn: Callable[[], object], calls: int = 1) -> float:
    """Microseconds per call of `fn` between a pair of CUDA events recorded around `calls`
    back-to-back calls (one sample: take the median of many). One call waits for nothing before
    it; more model an engine that enqueues the next step without waiting."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


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
