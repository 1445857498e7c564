"""Counting each fusion candidate's answers at run time (`counting_candidates`): per stage label,
per thread (so every rank of a threaded world counts its own), eager calls only. Inside
torch.compile the count is folded away at trace time: a fullgraph trace stays one graph with no
break, and nothing is counted for the calls a compiled graph makes."""

import pytest
import torch

from layer_boundary import Forward, Parallel, Topology
from layer_boundary._fusions import counting_candidates
from layer_boundary.compiling import CountingBackend, graph_breaks
from layer_boundary.testing.threaded import run_threaded

from test_compile_core import TP2Stack
from test_compile_fused import OpCandidate, StubPlugin, _stack

NAME = "stub.all_reduce_add_rmsnorm"
#: the inputs of a two-layer stack that complete a sum: the FFN inputs and the second attention's
OWED_INPUTS = ["call0.1:ffn", "call1.0:attention", "call1.1:ffn"]


@torch.inference_mode()
def test_eager_calls_are_counted_per_stage_label(fresh_registry, inline_plugin):
    plugin = StubPlugin(OpCandidate)
    parallel, stack = _stack(plugin, inline_plugin)
    x = torch.randn(4, 32)
    stack(x, Forward(parallel, 4))  # outside the block: not counted
    with counting_candidates() as counts:
        for _ in range(2):
            stack(x, Forward(parallel, 4))
    assert plugin.launches() == 9
    assert counts == {(label, NAME, "accepted"): 2 for label in OWED_INPUTS}


@pytest.mark.usefixtures("fresh_dynamo")
@torch.inference_mode()
def test_counting_is_folded_away_under_torch_compile(fresh_registry, inline_plugin):
    plugin = StubPlugin(OpCandidate)
    parallel, stack = _stack(plugin, inline_plugin)
    x = torch.randn(4, 32)
    backend = CountingBackend("aot_eager")
    compiled = torch.compile(stack, backend=backend, fullgraph=True)
    with counting_candidates() as counts:
        compiled(x, Forward(parallel, 4))
        compiled(x, Forward(parallel, 4))
        assert backend.graphs == 1 and graph_breaks() == 0
        assert counts == {}  # the graph runs the op it traced: no per-call count
        stack(x, Forward(parallel, 4))  # an eager call in the same block is counted
    assert counts == {(label, NAME, "accepted"): 1 for label in OWED_INPUTS}


def test_every_rank_thread_counts_its_own_calls():
    def rank(parallel):
        torch.manual_seed(0)
        stack = TP2Stack(parallel).eval()
        with torch.inference_mode(), counting_candidates() as counts:
            stack(torch.randn(3, 32), Forward(parallel, 3))
        return dict(counts)

    per_rank = run_threaded(rank, Topology(tp=2))
    assert per_rank[0] == per_rank[1] == {(label, "core.unfused", "accepted"): 1 for label in OWED_INPUTS}


def test_nothing_is_counted_outside_a_block():
    from layer_boundary import _fusions

    stack = TP2Stack(Parallel.single()).eval()
    with torch.inference_mode():
        stack(torch.randn(2, 32), Forward(Parallel.single(), 2))
    assert _fusions._COUNTING == {}
