"""Hyper-connection residuals (mhc, ihc) through the boundaries in the threaded world: every
layout gives a single rank's bits, zero-row ranks included; the single rank matches the
plain-torch formulas."""

import pytest
import torch

from layer_boundary import FusedMlpInput, FusionProvider, Priority, Topology, hookimpl
from layer_boundary.testing.threaded import run_threaded

from mhc_stack import plain_reference, run_stack_rank, single_rank, stack_inputs

LAYOUTS = {
    "tp2": (Topology(tp=2), (5,), "ar"),
    "tp4": (Topology(tp=4), (7,), "ar"),
    "tp4-ep2": (Topology(tp=4, moe_ep=2), (4,), "ar"),
    "dp2": (Topology(tp=2, attn_dp=2), (4, 3), "rs+rsv"),
    "dp2-zero": (Topology(tp=2, attn_dp=2), (3, 0), "ar"),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), (5, 3), "rs+rsv"),
    "dp2xtp2-zero": (Topology(tp=4, attn_dp=2), (0, 4), "rsv"),
    "dp4": (Topology(tp=4, attn_dp=4), (2, 0, 3, 1), "ar"),
}


def _assert_matches_single_rank(results, topology, counts, kind="mhc"):
    expected = single_rank(counts, kind)
    for rank, out in enumerate(results):
        dp_rank = topology.coordinates(rank)["attn_dp"]
        assert out.shape == expected[dp_rank].shape
        assert torch.equal(out, expected[dp_rank]), f"rank {rank}: max diff {(out - expected[dp_rank]).abs().max()}"


@pytest.mark.parametrize("kind", ["mhc", "ihc"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_a_single_ranks_bits(layout, kind):
    topology, counts, policy = LAYOUTS[layout]
    results = run_threaded(run_stack_rank, topology, counts, policy=policy, kind=kind)
    _assert_matches_single_rank(results, topology, counts, kind)


def test_max_len_padding_under_attention_dp():
    topology, counts = Topology(tp=4, attn_dp=2), (5, 2)
    results = run_threaded(run_stack_rank, topology, counts, policy="rs", padding="max_len")
    _assert_matches_single_rank(results, topology, counts)


@pytest.mark.parametrize("kind, tp, n", [("mhc", 2, 5), ("mhc", 4, 6), ("ihc", 2, 5)])
def test_sequence_parallel_slices_carry_their_coefficients(kind, tp, n):
    """On attention-TP slices each rank reads its own rows: the coefficients are computed on a
    slice (a float32 projection over fewer rows, so equal to ~1 ulp, not bitwise)."""
    results = run_threaded(run_stack_rank, Topology(tp=tp), (n,), policy="rs+rsv", sequence_parallel=True, kind=kind)
    (expected,) = single_rank((n,), kind)
    for out in results:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", ["mhc", "ihc"])
@pytest.mark.parametrize("n", [6, 1, 0])
def test_a_single_rank_follows_the_formulas(n, kind):
    x = stack_inputs((n,))[0]
    (ours,) = single_rank((n,), kind)
    torch.testing.assert_close(ours, plain_reference(x, kind), rtol=1e-6, atol=1e-9)


class _RecordingProvider:
    """A consumer candidate that records what it was offered and declines."""

    def __init__(self):
        self.offered = []

    def _decline(self, owed, residual, fwd):
        self.offered.append(type(residual).__name__)
        return None

    def attention_input(self, plan):
        return (FusedMlpInput(run=self._decline, name="test.recorder"),)

    ffn_input = attention_input


def test_no_fused_add_norm_candidate_is_ever_offered_an_mhc_update(inline_plugin):
    provider = _RecordingProvider()

    class Plugin:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield FusionProvider(name="test.recorder", factory=lambda stage: provider, priority=Priority.VENDOR)

    inline_plugin(Plugin(), name="test_recorder")
    topology, counts = Topology(tp=2), (5,)
    results = run_threaded(run_stack_rank, topology, counts)
    _assert_matches_single_rank(results, topology, counts)
    assert provider.offered == []
    # the same provider is offered a plain residual's sums (so the recorder can see them)
    from layer_boundary.testing.grid import GridSpec, run_grid_rank

    run_threaded(run_grid_rank, topology, GridSpec(stages=("attn", "ffn") * 2), counts)
    assert provider.offered and set(provider.offered) == {"Tensor"}
