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
