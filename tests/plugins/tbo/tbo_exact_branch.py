"""A LongCat-shaped stack in exact (grid) float64 arithmetic: per layer, attention, then a MoE on
the main line and a prepared branch of dense FFN -> attention -> dense FFN from the MoE's input,
merged at the end of the layer. `plain_reference` computes the same formula with no boundary
code at all, so a multi-rank run is checked against the model's math, not against itself.
"""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import (
    DpPadding,
    Forward,
    ForwardMode,
    Parallel,
    RMSNorm,
    branch_input,
    branch_output,
    declare_attn,
    declare_ffn,
    make_stages,
    merge_branch,
    residual_batch,
    two_batch_overlap,
)

from layer_boundary_models.overlapped import run_operations

from tbo_exact_stack import H, ExactStage, _weights, inputs_of, rows_of


class BranchLayer(nn.Module):
    def __init__(self, parallel, gen, *, first: bool, last: bool, policy="ar"):
        super().__init__()
        self.attn0 = ExactStage("attn", parallel, gen)
        self.moe = ExactStage("moe", parallel, gen)
        self.ffn0 = ExactStage("ffn", parallel, gen)
        self.attn1 = ExactStage("attn", parallel, gen)
        self.ffn1 = ExactStage("ffn", parallel, gen)
        self.attn0_b, self.moe_b = make_stages(
            (declare_attn(), self.attn0.norm),
            (declare_ffn(sparse=True, next_sparse=True), self.moe.norm),
            previous=None if first else declare_ffn(sparse=True, next_sparse=True),
            terminal=last,
            parallel=parallel,
            reduction=policy,
        )
        self.ffn0_b, self.attn1_b, self.ffn1_b = make_stages(
            (declare_ffn(), self.moe.norm),  # never applied: the MoE stage already read the input
            (declare_attn(), self.attn1.norm),
            (declare_ffn(), self.ffn1.norm),
            prepared_from=self.moe_b.declaration,
            parallel=parallel,
            reduction=policy,
        )

    def run(self, h, fwd, segments):
        x = self.attn0_b.prepare(h, fwd)
        h = self.attn0_b.finish(self.attn0.compute(x, segments), fwd)
        yield
        x = self.moe_b.prepare(h, fwd)
        xb, bfwd = branch_input(self.ffn0_b, x, fwd)
        with self.moe_b.exit(fwd) as out:
            m = self.moe.compute(x)
        m = out.finish(m)
        yield
        with self.ffn0_b.exit(bfwd) as out:
            y = self.ffn0.compute(xb)
        hb = out.finish(y)
        yield
        xb = self.attn1_b.prepare(hb, bfwd)
        hb = self.attn1_b.finish(self.attn1.compute(xb, segments), bfwd)
        yield
        xb = self.ffn1_b.prepare(hb, bfwd)
        with self.ffn1_b.exit(bfwd) as out:
            y = self.ffn1.compute(xb)
        hb = out.finish(y)
        return merge_branch(m, branch_output(hb, bfwd), fwd)


class BranchStack(nn.Module):
    def __init__(self, parallel, num_layers=2, *, seed=0, policy="ar"):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(
            BranchLayer(parallel, gen, first=i == 0, last=i == num_layers - 1, policy=policy) for i in range(num_layers)
        )
        self.final_norm = RMSNorm(H, 1e-6, dtype=torch.float64, compute_dtype=torch.float64)
        with torch.no_grad():
            self.final_norm.weight.copy_(1.0 + _weights(gen, H))

    def stages(self, h, fwd, segments):
        for layer in self.layers:
            h = yield from layer.run(h, fwd, segments)
        return h

    def run(self, x, fwd, segments, *, tbo=False, split=None):
        residual_batch.start(fwd)
        if tbo:
            h = two_batch_overlap(fwd).run(self.stages, x, fwd, context=lambda a, b: rows_of(segments, a, b), split=split)
        else:
            h = run_operations(self.stages(x, fwd, segments))
        return residual_batch.norm(h, fwd, self.final_norm)


@torch.inference_mode()
def plain_reference(dp_segments, num_layers=2) -> list:
    """The LongCat layer formula on one rank in plain torch (no boundaries)."""
    model = BranchStack(Parallel.single(), num_layers)
    outs = []
    for segments, r in zip(dp_segments, inputs_of(dp_segments)):
        for layer in model.layers:
            r0 = r + layer.attn0.compute(layer.attn0.norm(r), segments)
            x = layer.moe.norm(r0)
            m = layer.moe.compute(x)
            r1 = r0 + layer.ffn0.compute(x)
            r2 = r1 + layer.attn1.compute(layer.attn1.norm(r1), segments)
            r = r2 + layer.ffn1.compute(layer.ffn1.norm(r2)) + m
        outs.append(model.final_norm(r))
    return outs


@torch.inference_mode()
def run_branch_rank(parallel, dp_segments, *, policy="ar", padding="sum_len", tbo=False, split=None, num_layers=2):
    model = BranchStack(parallel, num_layers, policy=policy)
    segments = dp_segments[parallel.attn_dp_rank]
    x = inputs_of(dp_segments)[parallel.attn_dp_rank]
    fwd = Forward(
        parallel, x.shape[0], dp_counts=tuple(sum(s) for s in dp_segments), dp_padding=DpPadding(padding), mode=ForwardMode.EXTEND
    )
    return model.run(x, fwd, segments, tbo=tbo, split=split)
