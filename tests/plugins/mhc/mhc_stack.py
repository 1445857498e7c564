"""A small stack on a hyper-connection residual (mhc or ihc) for the test worlds, and an
independent plain-torch reference.

Compute is the grid's (float64, inputs rounded to 1/8, weights multiples of 1/8), so partial sums
are exact however ranks split them: a run on any layout must give the bits of a single rank run
on the same rows. Mapping weights are random; their coefficients run in float32 as mHC defines.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from layer_boundary import (
    ColumnParallelLinear,
    DpPadding,
    Forward,
    Parallel,
    RMSNorm,
    RowParallelLinear,
    declare_attn,
    declare_ffn,
    make_stages,
    residual_batch,
    residual_kind,
)
from layer_boundary.testing.grid import quant

H, STREAMS, WIDTH, LAYERS, ITERS, MAGNITUDE = 16, 3, 16, 2, 6, 2.0
EPS, RMS_EPS = 1e-6, 1e-6
#: per kind: (mapping rows, scales, kind options)
KINDS = {
    "mhc": ((2 + STREAMS) * STREAMS, 3, {"sinkhorn_iters": ITERS}),
    "ihc": (2 * STREAMS, 2, {"magnitude": MAGNITUDE}),
}


def _grid(gen, *shape):
    return torch.randint(-2, 3, shape, generator=gen).to(torch.float64) / 8


def _mapping(gen, rows, scales):
    return SimpleNamespace(
        fn=torch.randn(rows, STREAMS * H, generator=gen, dtype=torch.float64) / (STREAMS * H) ** 0.5,
        base=0.5 * torch.randn(rows, generator=gen, dtype=torch.float64),
        scale=1.0 + 0.1 * torch.randn(scales, generator=gen, dtype=torch.float64),
    )


def _norm(gen):
    norm = RMSNorm(H, EPS, dtype=torch.float64, compute_dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(1.0 + _grid(gen, H))
    return norm


class MhcLayer:
    def __init__(self, gen, parallel, head, previous, terminal, policy, fusions, kind):
        groups = parallel.groups
        rows, scales, options = KINDS[kind]
        self.attn_hc = _mapping(gen, rows, scales)
        self.ffn_hc = _mapping(gen, rows, scales)
        self.attn_norm, self.ffn_norm = _norm(gen), _norm(gen)
        self.attn_up = ColumnParallelLinear(H, WIDTH, groups["attn_tp"], dtype=torch.float64)
        self.attn_down = RowParallelLinear(WIDTH, H, groups["attn_tp"], reduce_results=False, dtype=torch.float64)
        self.ffn_up = ColumnParallelLinear(H, WIDTH, groups["tp"], dtype=torch.float64)
        self.ffn_down = RowParallelLinear(WIDTH, H, groups["tp"], dtype=torch.float64)
        for linear, shape in ((self.attn_up, (WIDTH, H)), (self.attn_down, (H, WIDTH)), (self.ffn_up, (WIDTH, H)), (self.ffn_down, (H, WIDTH))):
            linear.load_full(_grid(gen, *shape))
        self.ops = residual_kind(
            kind, streams=STREAMS, eps=EPS, rms_eps=RMS_EPS, attn=self.attn_hc, ffn=self.ffn_hc, head=head, **options
        )
        opts = {"fusions": fusions} if fusions is not None else {}
        self.attn, self.ffn = make_stages(
            (declare_attn(residual=self.ops), self.attn_norm, opts),
            (declare_ffn(residual=self.ops), self.ffn_norm, opts),
            previous=declare_ffn(residual=previous) if previous is not None else None,
            terminal=terminal,
            parallel=parallel,
            reduction=policy,
        )

    def attention(self, h):
        """Token mixing (a prefix sum over the rows), partial over attention TP."""
        return self.attn_down(quant(torch.cumsum(self.attn_up(quant(h)), dim=0) * 0.25))

    def mlp(self, h):
        return self.ffn_down(quant(self.ffn_up(quant(h)) * 0.5))


class MhcStack:
    def __init__(self, parallel, *, policy="ar", seed=0, fusions=None, kind="mhc"):
        gen = torch.Generator().manual_seed(seed)
        self.head = _mapping(gen, STREAMS, 1)
        self.layers, previous = [], None
        for i in range(LAYERS):
            layer = MhcLayer(gen, parallel, self.head, previous, i == LAYERS - 1, policy, fusions, kind)
            self.layers.append(layer)
            previous = layer.ops
        self.final_norm = _norm(gen)

    @torch.inference_mode()
    def run(self, x, fwd):
        residual_batch.start(fwd)
        h = x
        for layer in self.layers:
            h = layer.attn.finish(layer.attention(layer.attn.prepare(h, fwd)), fwd)
            inp = layer.ffn.prepare(h, fwd)
            with layer.ffn.exit(fwd) as out:
                y = layer.mlp(inp)
            h = out.finish(y)
        return residual_batch.norm(h, fwd, self.final_norm, final_read=self.layers[-1].ops.final_read)


def stack_inputs(counts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [_grid(gen, n, H) * 4 for n in counts]


def run_stack_rank(parallel, counts, *, policy="ar", padding="sum_len", sequence_parallel=False, fusions=None, kind="mhc"):
    x = stack_inputs(counts)[parallel.attn_dp_rank]
    fwd = Forward(parallel, x.shape[0], dp_counts=counts, dp_padding=DpPadding(padding), sequence_parallel=sequence_parallel)
    return MhcStack(parallel, policy=policy, fusions=fusions, kind=kind).run(x, fwd)


def single_rank(counts, kind="mhc"):
    """Each DP token set through the same stack on one rank."""
    stack = MhcStack(Parallel.single(), kind=kind)
    return [stack.run(x, Forward(Parallel.single(), x.shape[0])) for x in stack_inputs(counts)]


# an independent reference: the formulas, with none of the plugin's code ------------------------


def _gates(X, m):
    """The mapping's logits: scale * (fn @ x) / rms(x) + base, per coefficient group."""
    T, n, _ = X.shape
    x = X.reshape(T, n * H).float()
    mix = torch.rsqrt(x.pow(2).mean(-1) + RMS_EPS)[:, None] * (x @ m.fn.float().T)
    sizes = [n, n, n * n][: len(m.scale)]
    return mix.double() * torch.cat([m.scale[k].repeat(size) for k, size in enumerate(sizes)]) + m.base


def _mhc_stage(X, m, compute, norm):
    n = X.shape[1]
    z = _gates(X, m)
    pre = torch.sigmoid(z[:, :n]) + EPS
    post = 2 * torch.sigmoid(z[:, n : 2 * n])
    comb = torch.exp(z[:, 2 * n :].reshape(-1, n, n))
    comb = comb / comb.sum(-1, keepdim=True) + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    F = compute(norm((pre[..., None] * X).sum(1)))
    return post[..., None] * F[:, None, :] + torch.einsum("tio,tih->toh", comb, X)


def _ihc_stage(X, m, compute, norm):
    n = X.shape[1]
    z = _gates(X, m)
    pre = torch.sigmoid(z[:, :n]) + EPS
    post = MAGNITUDE * torch.sigmoid(z[:, n:]) + EPS
    F = compute(norm((pre[..., None] * X).sum(1)))
    return post[..., None] * F[:, None, :] + X


def plain_reference(x, kind="mhc"):
    """The stack's output from the formulas: expand, per stage coefficients -> collapse -> norm ->
    compute -> write back (mhc: post F + comb^T X; ihc: post F + X), then the head contraction and
    the final norm."""
    stack = MhcStack(Parallel.single(), kind=kind)
    stage = {"mhc": _mhc_stage, "ihc": _ihc_stage}[kind]
    X = x[:, None, :].repeat(1, STREAMS, 1)
    for layer in stack.layers:
        X = stage(X, layer.attn_hc, layer.attention, layer.attn_norm)
        X = stage(X, layer.ffn_hc, layer.mlp, layer.ffn_norm)
    w = torch.sigmoid(_gates(X, stack.head).float()) + EPS
    return stack.final_norm((w[..., None] * X).sum(1))
