"""The grid stack of `layer_boundary.testing.grid` under a context-parallel batch.

Stage codes are the grid's, plus two that compute on their CP rank's rows only and fetch the
other rows themselves (declared `takes_cp_shard=True`): "shard_attn" and "shard_mixer". They
compute exactly what "attn" and "mixer" compute (a prefix sum over every row in token order), so
the single-rank reference is the plain grid with those codes.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from layer_boundary import CollectiveCounter, CountingCollectives, Forward, make_stages, residual_batch
from layer_boundary.testing.grid import GridSpec, _Stage, grid_inputs, quant, reference

SHARD_CODES = {"shard_attn": "attn", "shard_mixer": "mixer"}


def reference_spec(spec: GridSpec) -> GridSpec:
    return attrs.evolve(spec, stages=tuple(SHARD_CODES.get(c, c) for c in spec.stages))


class CpStage(_Stage):
    def __init__(self, code, spec, parallel, gen):
        super().__init__(SHARD_CODES.get(code, code), spec, parallel, gen)
        self.shard = code in SHARD_CODES

    def declaration(self, transform: bool):
        decl = super().declaration(transform)
        return attrs.evolve(decl, takes_cp_shard=True) if self.shard else decl

    def compute_on(self, h, fwd):
        if not (self.shard and fwd.cp is not None):
            return self.compute(h)
        # the prefix sum needs every row before this one: gather the projection, take ours back
        mixed = fwd.cp.gather(self.up(quant(h)))
        return self.down(fwd.cp.take_local(quant(torch.cumsum(mixed, dim=0) * 0.25)))


class CpGridModel(nn.Module):
    """One make_stages call per stage (the grid's unpaired form), on `parallel`."""

    def __init__(self, spec: GridSpec, parallel, *, policy="ar"):
        super().__init__()
        gen = torch.Generator().manual_seed(spec.seed)
        self.stages = nn.ModuleList(CpStage(c, spec, parallel, gen) for c in spec.stages)
        self.final_norm = _final_norm(spec, gen)
        decls = [s.declaration(i in spec.transforms) for i, s in enumerate(self.stages)]
        n = len(decls)
        self.boundaries = [
            make_stages(
                (decls[i], stage.norm),
                previous=decls[i - 1] if i else None,
                following=decls[i + 1] if i + 1 < n else None,
                terminal=i == n - 1,
                parallel=parallel,
                reduction=policy,
                label=f"stage{i}",
            )[0]
            for i, stage in enumerate(self.stages)
        ]

    def run(self, h, fwd, *, captures=(), collector=None, scheduled=False, capture_inputs=False):
        """`scheduled`: FFNs and mixers run without an exit scope (compute reduces fully) and
        publish through `postprocess`, as operation-scheduled overlap does. `capture_inputs`:
        capture with `captured_last_layer_outputs` (on the compute input's rows) instead."""
        residual_batch.start(fwd)
        for index, (stage, boundary) in enumerate(zip(self.stages, self.boundaries)):
            kwargs = {}
            if index in captures and stage.code in ("attn", "mixer"):
                key = "captured_last_layer_outputs" if capture_inputs else "capture_output"
                kwargs[key] = lambda v, owned=False, _i=index: collector.append((_i, v.clone()))
            x = boundary.prepare(h, fwd, **kwargs)
            if stage.code == "attn":
                h = boundary.finish(stage.compute_on(x, fwd), fwd)
            elif scheduled:
                h = boundary.postprocess(stage.compute_on(x, fwd), fwd)
            else:
                with boundary.exit(fwd) as out:
                    y = stage.compute_on(x, fwd)
                h = out.finish(y)
        return residual_batch.norm(h, fwd, self.final_norm)


def _final_norm(spec, gen):
    # drawn after the stages, as the grid does, so the reference gets the same weights
    from layer_boundary import RMSNorm
    from layer_boundary.testing.grid import _weights

    norm = RMSNorm(spec.hidden, 1e-6, dtype=torch.float64, compute_dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(1.0 + _weights(gen, spec.hidden))
    return norm


@torch.inference_mode()
def run_cp_grid_rank(
    parallel, spec: GridSpec, lengths, *, order="zigzag", policy="ar", captures=(), cp=True, scheduled=False, padding="sum_len",
    capture_inputs=False,
):
    """One rank of a CP batch (or, with cp=False, the same batch as an ordinary one): returns
    (normed rows of its DP rank's batch in token order, captures, collectives by kind and group).

    `lengths`: the request lengths of the batch, or under attention DP one tuple per DP rank."""
    from layer_boundary_cp import TokenMapping

    counter = CollectiveCounter()
    counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    model = CpGridModel(spec, counted, policy=policy)
    per_dp = per_dp_lengths(parallel.topology, lengths)
    dp_counts = tuple(sum(ls) for ls in per_dp)
    mine = per_dp[parallel.attn_dp_rank]
    x = grid_inputs(spec, dp_counts)[parallel.attn_dp_rank]
    mapping = TokenMapping(counted, mine, order=order) if cp else None
    fwd = Forward(counted, sum(mine), dp_counts=dp_counts, dp_padding=padding, cp=mapping)
    collector: list = []
    out = model.run(x, fwd, captures=captures, collector=collector, scheduled=scheduled, capture_inputs=capture_inputs)
    return out, collector, counter.snapshot()


def planning_parallel(topology, rank=0):
    """A rank's Parallel whose groups know their ranks but never communicate (construction only)."""
    from layer_boundary import Parallel
    from layer_boundary.cli.plan_cmd import PlanningCollectives

    return Parallel.create(topology, rank, lambda name, ranks: PlanningCollectives(name, ranks, rank))


def per_dp_lengths(topology, lengths) -> tuple:
    return tuple(lengths) if topology.attn_dp > 1 else (tuple(lengths),)


def assert_matches_single_rank(results, spec: GridSpec, n, captures=(), topology=None):
    """`n`: the batch's rows, or under attention DP (with `topology`) the per-DP-rank lengths."""
    if topology is not None and topology.attn_dp > 1:
        dp_counts = tuple(sum(ls) for ls in n)
        outs, caps_by_dp = reference(reference_spec(spec), grid_inputs(spec, dp_counts), captures=captures)
        for rank, result in enumerate(results):
            d = topology.coordinates(rank)["attn_dp"]
            _assert_rank(rank, result, outs[d], caps_by_dp[d])
        return
    (expected,), (expected_caps,) = reference(reference_spec(spec), grid_inputs(spec, (n,)), captures=captures)
    for rank, result in enumerate(results):
        _assert_rank(rank, result, expected, expected_caps)


def _assert_rank(rank, result, expected, expected_caps):
    out, caps, _ = result
    assert out.shape == expected.shape, (rank, out.shape)
    assert torch.equal(out, expected), f"rank {rank}: max diff {(out - expected).abs().max().item()}"
    assert [i for i, _ in caps] == [i for i, _ in expected_caps], rank
    for (i, got), (_, want) in zip(caps, expected_caps):
        assert torch.equal(got, want), f"rank {rank}: capture at stage {i} differs"
