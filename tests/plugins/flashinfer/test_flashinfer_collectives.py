"""FlashInfer's plain all-reduce as the model's custom all-reduce (`flashinfer_collectives`): the
sums the boundaries leave unfused run on the workspace once prepared, the same logits, the
wrapped group again after release; which path a tensor takes depends only on shape and dtype."""

import pytest
import torch

from flashinfer_fakes import on_off_run
from layer_boundary import Parallel, Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.collectives import FlashInferCollectives, flashinfer_collectives, wrapped_flashinfer_collectives

TP2 = Topology(tp=2)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_the_unfused_sums_run_on_the_workspace_and_change_no_logit(name):
    results = run_threaded(on_off_run, TP2, name, {}, 64, True, timeout=60)
    for res in results:
        report = res["report"]
        assert report.collectives and all(c.endswith("float32") for c in report.collectives)
        assert "on the workspace" in str(report)
        # 2 forwards: each one's terminal FFN sum meets the final norm, which has no fused candidate
        assert res["launches"]["plain_all_reduce"] >= 2
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["after_release"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["fused"], results[1]["fused"]))


class _Inner:
    name, size, rank, ranks, device = "tp", 2, 0, (0, 1), "cpu"

    def __init__(self):
        self.calls = []

    def all_reduce(self, x):
        self.calls.append(tuple(x.shape))
        return x


def test_which_tensors_the_kernel_takes():
    inner = _Inner()
    fi = FlashInferCollectives(inner)
    launched = []
    fi.bind(torch.float32, lambda rows: launched.append(tuple(rows.shape)) or rows, max_tokens=8, hidden=64, cuda=False)
    fi.all_reduce(torch.ones(3, 64))  # rows of a width the kernel takes
    fi.all_reduce(torch.ones(2, 128))  # wider rows, within the workspace's elements
    fi.all_reduce(torch.ones(4, 2, 64))  # leading dimensions flatten
    fi.all_reduce(torch.ones(6, 6))  # width 6 is no 16-byte multiple, and 36 elements are no row of 64
    fi.all_reduce(torch.ones(9, 64))  # more elements than the workspace holds
    fi.all_reduce(torch.ones(3, 64, dtype=torch.float64))  # no workspace for float64
    fi.all_reduce(torch.ones(128))  # one dimension: rows of the workspace width
    assert launched == [(3, 64), (2, 128), (8, 64), (2, 64)]
    assert inner.calls == [(6, 6), (9, 64), (3, 64)]
    assert fi.kernel_calls == 4
    fi.unbind()
    fi.all_reduce(torch.ones(3, 64))
    assert inner.calls[-1] == (3, 64) and fi.bound_dtypes == ()


def test_wrapping_is_idempotent_and_found_through_other_wrappers():
    from layer_boundary import CollectiveCounter, CountingCollectives

    def rank(parallel):
        wrapped = flashinfer_collectives(parallel)
        again = flashinfer_collectives(wrapped.with_groups(lambda g: CountingCollectives(g, CollectiveCounter())))
        found = wrapped_flashinfer_collectives(again.groups.values())
        return len(found), isinstance(wrapped.groups["tp"], FlashInferCollectives), isinstance(wrapped.groups["pp"], FlashInferCollectives)

    # tp, attn_tp and moe_tp (one each, not wrapped twice); pp has one rank
    assert run_threaded(rank, TP2, timeout=30) == [(3, True, False)] * 2
    assert flashinfer_collectives(Parallel.single()).groups["tp"].size == 1
