"""The one-shot all-reduce kernels on the GPU, 2 and 4 ranks, against float64.

    python -m pytest -q -m gpu tests/plugins/cutedsl/test_allreduce_gpu.py

Ranks are processes of the core's `gpu_world` fixture (`ProcessWorld(n, device="cuda")`): one
GPU each when there are enough, else sharing the GPUs (gloo, CUDA IPC within a device; the
kernels of two processes time-slice, so every check is kept to a few launches). The checks themselves live in
allreduce_checks.py (test_allreduce_cpu.py runs them dry on CPU ranks); each returns one row per
rank and launch, asserted here and printed as a table at the end of the pytest run.
"""

import importlib.util

import pytest
import torch

from layer_boundary import Topology

from .allreduce_checks import (
    check_boundary,
    check_delayed,
    check_graph,
    check_moe,
    check_release,
    check_timeout_in_subprocess,
    world_note,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not importable"),
]

#: rows of every check, printed by conftest.py's terminal summary
RESULTS: list = []
CASE_TIMEOUT = 150.0


def _run(gpu_world, ranks, fn, *args, **kwargs):
    per_rank = gpu_world(ranks).run(fn, Topology(tp=ranks), *args, timeout=CASE_TIMEOUT, **kwargs)
    rows = [dict(row, ranks=ranks, world=world_note(ranks)) for rank_rows in per_rank for row in rank_rows]
    RESULTS.extend(rows)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(
        f"{r['case']} rank {r['rank']}: err/bound normed {r['err_normed']}, residual {r['err_residual']}, vs unfused {r['vs_unfused']} {r['detail']}"
        for r in bad
    )
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], set()).add(r["digest"])
    differ = {case: d for case, d in by_case.items() if len(d) > 1}
    assert not differ, f"ranks computed different outputs: {differ}"
    return rows


@pytest.mark.parametrize("ranks", [2, 4])
def test_boundary_token_counts(gpu_world, ranks):
    """Tokens 1, 7, 128 and one above a wave (133 rows on 132 SMs: a CTA does two rows), against
    float64 and the unfused path; all ranks bit-identical."""
    _run(gpu_world, ranks, check_boundary, "bf16", 4096, 0.0, (1, 7, 128, 133))


@pytest.mark.parametrize("dtype, hidden, tokens", [("bf16", 2880, (1, 133)), ("fp16", 4096, (7,))])
def test_boundary_gemma(gpu_world, dtype, hidden, tokens):
    """The Gemma (1 + w) multiplier; a width that needs bounds checks; fp16."""
    _run(gpu_world, 2, check_boundary, dtype, hidden, 1.0, tokens)


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_with_different_grids(gpu_world, ranks):
    """Each rank caps its grid differently (3, 5, 7, 9 CTAs looping over 133 rows): rows still
    meet row by row, whatever CTA holds them on each rank."""
    _run(gpu_world, ranks, check_boundary, "bf16", 1024, 0.0, (133,), unfused=False, max_ctas=[3 + 2 * r for r in range(ranks)])


@pytest.mark.parametrize("ranks, shared, tokens", [(2, True, (7, 133)), (2, False, (7,)), (4, True, (7,))])
def test_moe_finalize(gpu_world, ranks, shared, tokens):
    """finalize top-k rows (+ shared expert) locally, then the same exchange + add + norm."""
    _run(gpu_world, ranks, check_moe, 2048, 8, shared, tokens)


@pytest.mark.parametrize("ranks, replays", [(2, 3), (4, 2)])
def test_graph_replay_equals_eager(gpu_world, ranks, replays):
    """Two launches captured in one graph, replayed with new inputs, alternating with eager
    launches: the epoch counter lives on the device, so each replay takes the next parity."""
    _run(gpu_world, ranks, check_graph, 4096, 16, replays)


@pytest.mark.parametrize("ranks, delayed", [(2, 0), (2, 1), (4, 3)])
def test_a_late_rank(gpu_world, ranks, delayed):
    _run(gpu_world, ranks, check_delayed, delayed, 1.0)


def test_release_gives_the_memory_back(gpu_world):
    _run(gpu_world, 2, check_release, 8192, 2048)


def test_a_missing_peer_traps_instead_of_hanging():
    """One launch whose peer never publishes: the kernel reports to host memory and traps after
    its 2 s timeout (in a process of its own: the trap ends that process's CUDA context)."""
    row, problem = check_timeout_in_subprocess(2.0, limit=120.0)
    assert row is not None, problem
    RESULTS.append(dict(row, ranks=1, world="1 process"))
    assert row["ok"], row["detail"]
