"""Compiled against eager on one rank: what the compile tests run in every world."""

from __future__ import annotations

import attrs
import torch

from layer_boundary.cli.runner import run_rank

__all__ = ["compiled_vs_eager"]


def compiled_vs_eager(parallel, job, backend: str = "eager") -> dict:
    """Run `job` eagerly, then every step through `torch.compile(..., fullgraph=True)` with
    `backend`; the graphs compiled, Dynamo's graph-break count, and how the logits compare
    (`equal`: bit for bit; `max_diff`: the largest absolute difference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: one thread is fastest, and ranks share the cores
    try:
        eager = run_rank(parallel, attrs.evolve(job, compile=None))
        compiled = run_rank(parallel, attrs.evolve(job, compile=backend))
    finally:
        torch.set_num_threads(threads)
    equal, diff = True, 0.0
    for rid, steps in eager["logits"].items():
        for a, b in zip(steps, compiled["logits"][rid], strict=True):
            equal = equal and torch.equal(a, b)
            diff = max(diff, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return {
        "rank": parallel.rank,
        "graphs": compiled["graphs"],
        "graph_breaks": compiled["graph_breaks"],
        "equal": equal,
        "max_diff": diff,
        "steps": len(compiled["timings"]),
    }
