"""The benchmark's CPU-checkable parts: the boundary pair it times (through the reference backend,
equal to the unfused path), the target verdicts, the table, and the CLI refusing to run without
GPUs."""

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present
from layer_boundary import MoeFinalizeHandoff, SumGroup, Topology
from layer_boundary.cli.main import main as cli_main
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.bench import BoundaryPair, evaluate_targets, format_table
from layer_boundary_flashinfer.service import prepare_flashinfer_fusion
from layer_boundary_flashinfer.workspace import WorkspaceManager

HIDDEN = 32


def _pair_run(parallel, gemma, sparse):
    backend = ReferenceBackend(finalize_tokens=4)
    manager = WorkspaceManager(backend)
    with hardware_present():
        pair = BoundaryPair(parallel, HIDDEN, torch.float32, "cpu", gemma=gemma, sparse=sparse)
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=16, manager=manager)
    group = parallel.groups["tp"]
    out = []
    for tokens in (1, 3, 6):
        gen = torch.Generator().manual_seed(tokens)
        residual = torch.randn(tokens, HIDDEN, generator=gen)
        mine = torch.Generator().manual_seed(tokens + 100 * parallel.rank)
        if sparse:
            rows, weights = torch.randn(tokens, 2, HIDDEN, generator=mine), torch.rand(tokens, 2, generator=mine)
            make = lambda: MoeFinalizeHandoff(rows, weights, torch.zeros(tokens, 2, dtype=torch.long), None, group, SumGroup.MOE_OUTPUT)  # noqa: E731
            value = lambda out: make()  # noqa: E731
            want = pair.norm.add_forward(make().complete(), residual)
        else:
            partial = torch.randn(tokens, HIDDEN, generator=mine)
            value = partial.clone()
            want = pair.norm.add_forward(group.all_reduce(partial.clone()), residual)
        fwd = pair.start(residual)
        got = pair.step(value, fwd)
        out.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    manager.shutdown()
    return report, out, {k: backend.count(k, parallel.rank) for k in ("all_reduce", "finalize")}


@pytest.mark.parametrize("gemma,sparse", [(False, False), (True, False), (False, True)])
def test_the_timed_boundary_is_the_fused_candidate_and_matches_unfused(gemma, sparse):
    for report, equal, launches in run_threaded(_pair_run, Topology(tp=2), gemma, sparse, timeout=60):
        assert report.available and len(report.bound) == 3 and len(report.finalize) == (1 if sparse else 0)
        assert equal == [True, True, True]
        # three boundaries; a MoE's 6-token handoff is above the fake kernel's 4: torch combine + fused all-reduce
        assert launches == ({"all_reduce": 1, "finalize": 2} if sparse else {"all_reduce": 3, "finalize": 0})


def _row(hidden, tokens, graph, eager, equal=True):
    return {"hidden": hidden, "tokens": tokens, "graph_us": dict(zip(("unfused", "raw", "ours"), graph)),
            "eager_us": dict(zip(("unfused", "raw", "ours"), eager)), "graph_ours_over_raw": graph[2] / graph[1],
            "eager_ours_over_raw": eager[2] / eager[1], "graph_unfused_over_ours": graph[0] / graph[2],
            "eager_unfused_over_ours": eager[0] / eager[2],
            "check": {"ours_equals_raw": equal, "unfused_rel_err_norm": 3e-3, "unfused_rel_err_residual": 1e-3}}


def test_target_verdicts():
    good = [_row(4096, 1, (25.5, 6.1, 6.2), (225.0, 52.0, 20.0)), _row(4096, 128, (44.0, 9.0, 9.1), (230.0, 53.0, 21.0)),
            _row(4096, 2048, (218.5, 86.7, 88.0), (300.0, 120.0, 121.0))]
    verdict = evaluate_targets(good)["4096"]
    assert all(v["ok"] for k, v in verdict.items() if isinstance(v, dict)) and verdict["outputs_checked"]
    bad = [_row(8192, 1, (25.5, 6.1, 6.4), (225.0, 52.0, 30.0)), _row(8192, 64, (20.0, 8.0, 8.0), (230.0, 53.0, 21.0), equal=False)]
    verdict = evaluate_targets(bad)["8192"]
    assert not verdict["graph_ours_over_raw_max"]["ok"] and not verdict["eager_ours_over_raw_at_1"]["ok"]
    assert not verdict["graph_unfused_over_ours_min_to_128"]["ok"] and not verdict["outputs_checked"]
    table = format_table(good)
    assert table.splitlines()[2].split()[:2] == ["4096", "1"] and "True" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_the_cli_refuses_without_gpus(capsys):
    assert cli_main(["bench", "fusion"]) == 2
    assert "bench fusion needs CUDA GPUs" in capsys.readouterr().err
