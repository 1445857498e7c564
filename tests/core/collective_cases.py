"""Rank functions shared by the threaded and gloo worlds (importable by spawned workers)."""

import torch


def _rank_tensor(rank, rows, cols=3, scale=1.0):
    base = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
    return (base + 100 * rank) * scale


def every_collective(parallel):
    """Each Collectives op on the TP group, with even, uneven and empty shards."""
    g = parallel.groups["tp"]
    n, r = g.size, g.rank
    uneven = [(i * 2 + 1) % 3 for i in range(n)]  # includes zero-row ranks from n >= 2
    out = {
        "all_reduce": g.all_reduce(_rank_tensor(r, 5)),
        "all_reduce_empty": g.all_reduce(_rank_tensor(r, 0)),
        "reduce_scatter": g.reduce_scatter(_rank_tensor(r, 2 * n)),
        "reduce_scatter_empty": g.reduce_scatter(_rank_tensor(r, 0)),
        "reduce_scatterv": g.reduce_scatterv(_rank_tensor(r, sum(uneven)), uneven),
        "reduce_scatterv_zeros": g.reduce_scatterv(_rank_tensor(r, 0), [0] * n),
        "all_gather": g.all_gather(_rank_tensor(r, 2)),
        "all_gather_empty": g.all_gather(_rank_tensor(r, 0)),
        "all_gatherv": g.all_gatherv(_rank_tensor(r, uneven[r]), uneven),
        "all_gatherv_zeros": g.all_gatherv(_rank_tensor(r, 0), [0] * n),
    }
    return {k: v.clone() for k, v in out.items()}


def expected(n, r):
    uneven = [(i * 2 + 1) % 3 for i in range(n)]
    total = lambda rows: sum(_rank_tensor(i, rows) for i in range(n))  # noqa: E731
    start = sum(uneven[:r])
    return {
        "all_reduce": total(5),
        "all_reduce_empty": _rank_tensor(0, 0),
        "reduce_scatter": total(2 * n)[2 * r : 2 * r + 2],
        "reduce_scatter_empty": _rank_tensor(0, 0),
        "reduce_scatterv": total(sum(uneven))[start : start + uneven[r]],
        "reduce_scatterv_zeros": _rank_tensor(0, 0),
        "all_gather": torch.cat([_rank_tensor(i, 2) for i in range(n)]),
        "all_gather_empty": _rank_tensor(0, 0),
        "all_gatherv": torch.cat([_rank_tensor(i, uneven[i]) for i in range(n)]),
        "all_gatherv_zeros": _rank_tensor(0, 0),
    }


def group_layout(parallel):
    return {name: (g.size, g.rank, tuple(g.ranks)) for name, g in parallel.groups.items()}
