"""Shared helpers: run a grid configuration in a world and compare with a single rank."""

import torch

from layer_boundary.testing.grid import grid_inputs, reference


def assert_matches_reference(results, spec, topology, dp_counts, captures=()):
    ref, ref_caps = reference(spec, grid_inputs(spec, dp_counts), captures=captures)
    for rank, (out, caps) in enumerate(results):
        d = topology.coordinates(rank)["attn_dp"]
        assert out.shape == ref[d].shape, (rank, out.shape, ref[d].shape)
        assert torch.equal(out, ref[d]), f"rank {rank}: max diff {(out - ref[d]).abs().max().item()}"
        assert [i for i, _ in caps] == [i for i, _ in ref_caps[d]], rank
        for (i, got), (_, want) in zip(caps, ref_caps[d]):
            assert torch.equal(got, want), f"rank {rank}: capture at stage {i} differs"


def counted_grid_rank(parallel, *args, **kwargs):
    """`run_grid_rank` on groups that count what they issue: (normed rows, {collective: calls})."""
    from layer_boundary import CollectiveCounter, CountingCollectives
    from layer_boundary.testing.grid import run_grid_rank

    counter = CollectiveCounter()
    out, _ = run_grid_rank(parallel.with_groups(lambda g: CountingCollectives(g, counter)), *args, **kwargs)
    return out, dict(counter.snapshot())
