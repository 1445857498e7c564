"""A float64 layer stack with exact (grid) arithmetic whose token mixing stays inside requests.

Attention takes a prefix sum within each request, so a batch cut at request boundaries gives
the same rows whether it runs whole or as two TBO microbatches; every weight and compute input
sits on the 1/8 grid, so sums are exact in any order and every topology matches a single rank
bit for bit. A misplaced row, a sum done twice or skipped, or a wrong residual shows up as a bit
difference.

Stage codes per layer: ("attn", "ffn") or ("attn", "moe"). `scheduled` names the layers whose FFN
runs operation-scheduled: no exit() scope, yields inside the FFN, `boundary.postprocess()`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from layer_boundary import (
    ColumnParallelLinear,
    DpPadding,
    Forward,
    ForwardMode,
    MoeFinalizeHandoff,
    Parallel,
    RMSNorm,
    RowParallelLinear,
    SumGroup,
    declare_attn,
    declare_ffn,
    get_forward,
    make_stages,
    reduce_output,
    residual_batch,
    two_batch_overlap,
)
from layer_boundary._layers import shard_cols, shard_rows
from layer_boundary_models.overlapped import run_operations
from layer_boundary.testing.grid import quant

H = 16


def _weights(gen, *shape, device=None):
    w = torch.randint(-2, 3, shape, generator=gen, dtype=torch.int64).to(torch.float64) / 8.0
    return w if device is None else w.to(device)


def segment_prefix_sum(t: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
    if t.shape[0] == 0:
        return t
    return torch.cat([part.cumsum(0) for part in t.split(list(segments))])


class ExactStage(nn.Module):
    def __init__(self, code: str, parallel: Parallel, gen, *, device=None):
        super().__init__()
        self.code = code
        groups = parallel.groups
        self.norm = RMSNorm(H, 1e-6, dtype=torch.float64, compute_dtype=torch.float64, device=device)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + _weights(gen, H))
        if code == "attn":
            g = groups["attn_tp"]
            self.up = ColumnParallelLinear(H, 16, g, dtype=torch.float64, device=device)
            self.down = RowParallelLinear(16, H, g, reduce_results=False, dtype=torch.float64, device=device)
            self.up.load_full(_weights(gen, 16, H, device=device))
            self.down.load_full(_weights(gen, H, 16, device=device))
        elif code == "ffn":
            g = groups["tp"]
            self.up = ColumnParallelLinear(H, 32, g, dtype=torch.float64, device=device)
            self.down = RowParallelLinear(32, H, g, dtype=torch.float64, device=device)
            self.up.load_full(_weights(gen, 32, H, device=device))
            self.down.load_full(_weights(gen, H, 32, device=device))
        elif code == "moe":
            topo = parallel.topology
            self.group = groups["tp"]
            self.router = _weights(gen, 4, H, device=device)
            per_rank = 4 // topo.moe_ep
            first = parallel.moe_ep_rank * per_rank
            self.owned = range(first, first + per_rank)
            ups = [_weights(gen, 16, H, device=device) for _ in range(4)]
            downs = [_weights(gen, H, 16, device=device) for _ in range(4)]
            r, s = parallel.moe_tp_rank, topo.moe_tp
            self.expert_up = {e: shard_rows(ups[e], r, s) for e in self.owned}
            self.expert_down = {e: shard_cols(downs[e], r, s) for e in self.owned}
            self.route = torch.tensor([0.75, 0.25], dtype=torch.float64, device=device)
            # logits are multiples of 1/64: distinct offsets below that make the choice tie-free,
            # so no device or batch size can break a tie another way
            self.tiebreak = torch.arange(4, dtype=torch.float64, device=device) / 1024
        else:
            raise ValueError(code)

    def declaration(self, next_sparse=False):
        if self.code == "attn":
            return declare_attn()
        return declare_ffn(sparse=self.code == "moe", next_sparse=next_sparse)

    def compute(self, h: torch.Tensor, segments=()) -> object:
        if self.code == "attn":
            t = quant(segment_prefix_sum(self.up(quant(h)), segments) * 0.25)
            return self.down(t)
        if self.code == "ffn":
            return self.down(quant(self.up(quant(h)) * 0.5))
        q = quant(h)
        _, idx = torch.topk(q @ self.router.T + self.tiebreak, 2, dim=-1)
        rows = q.new_zeros(q.shape[0], 2, q.shape[1])
        for e in self.owned:
            tok, k = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                rows[tok, k] = quant((q[tok] @ self.expert_up[e].T) * 0.5) @ self.expert_down[e].T
        weights = self.route.expand(q.shape[0], -1)
        if get_forward().defer_moe_finalize:
            return MoeFinalizeHandoff(rows, weights, idx, None, self.group, SumGroup.MOE_OUTPUT)
        return reduce_output((rows * weights.unsqueeze(-1)).sum(dim=1), self.group)


class ExactStack(nn.Module):
    """`layers`: the FFN code of each layer ("ffn" or "moe"); each layer is attention + that FFN."""

    def __init__(self, layers: Sequence[str], parallel: Parallel, *, seed=0, policy="ar", scheduled=(), fusions=None, device=None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.scheduled = frozenset(scheduled)
        self.stages = nn.ModuleList()
        self.boundaries = []
        codes = list(layers)
        previous = None
        options = {"fusions": fusions} if fusions is not None else {}
        for i, code in enumerate(codes):
            attn, ffn = ExactStage("attn", parallel, gen, device=device), ExactStage(code, parallel, gen, device=device)
            self.stages.extend([attn, ffn])
            ffn_decl = ffn.declaration(next_sparse=i + 1 < len(codes) and codes[i + 1] == "moe")
            self.boundaries += make_stages(
                (attn.declaration(), attn.norm, options),
                (ffn_decl, ffn.norm, options),
                previous=previous,
                terminal=i == len(codes) - 1,
                parallel=parallel,
                reduction=policy,
                label=f"layer{i}",
            )
            previous = ffn_decl
        self.final_norm = RMSNorm(H, 1e-6, dtype=torch.float64, compute_dtype=torch.float64, device=device)
        with torch.no_grad():
            self.final_norm.weight.copy_(1.0 + _weights(gen, H))

    @property
    def num_layers(self) -> int:
        return len(self.stages) // 2

    # one layer, as a generator: `yield` where another microbatch may run ----------------------
    def layer(self, i: int, h, fwd: Forward, segments):
        attn, ffn = self.stages[2 * i], self.stages[2 * i + 1]
        attn_b, ffn_b = self.boundaries[2 * i], self.boundaries[2 * i + 1]
        x = attn_b.prepare(h, fwd)
        h = attn_b.finish(attn.compute(x, segments), fwd)
        yield
        x = ffn_b.prepare(h, fwd)
        if i in self.scheduled:  # operation-scheduled: no exit scope, compute reduces itself
            yield
            y = ffn.compute(x)
            yield
            h = ffn_b.postprocess(y, fwd)
        else:
            with ffn_b.exit(fwd) as out:
                y = ffn.compute(x)
            h = out.finish(y)
        yield
        return h

    def stages_of(self, first: int, last: int, *, final_norm=False):
        """A stages generator function for layers first..last-1 (for the TBO adapter)."""

        def stages(h, fwd, segments):
            for i in range(first, last):
                h = yield from self.layer(i, h, fwd, segments)
            if final_norm:
                return residual_batch.norm(h, fwd, self.final_norm)
            return h

        return stages

    def run(self, x, fwd: Forward, segments, *, tbo=False, tbo_from=0, split=None, norm_in_stages=False, streams=None):
        residual_batch.start(fwd)
        h = x
        serial = self.stages_of(0, tbo_from if tbo else self.num_layers)
        h = run_operations(serial(h, fwd, segments))
        if tbo:
            stages = self.stages_of(tbo_from, self.num_layers, final_norm=norm_in_stages)
            h = two_batch_overlap(fwd).run(
                stages, h, fwd, context=lambda a, b: rows_of(segments, a, b), split=split, streams=streams
            )
            if norm_in_stages:
                return h
        return residual_batch.norm(h, fwd, self.final_norm)


def rows_of(segments: Sequence[int], start: int, stop: int) -> list:
    """The requests of rows start:stop; the cut must fall on request boundaries."""
    out, offset = [], 0
    for n in segments:
        a, b = max(start, offset), min(stop, offset + n)
        if a < b:
            if (a, b) != (offset, offset + n):
                raise ValueError(f"rows {start}:{stop} cut a request ({offset}:{offset + n})")
            out.append(n)
        offset += n
    return out


def balanced_cut(segments: Sequence[int]) -> int:
    """The request boundary closest to half the rows (what an engine's scheduler would pick)."""
    total, best, offset = sum(segments), 0, 0
    for n in segments:
        offset += n
        if abs(2 * offset - total) < abs(2 * best - total):
            best = offset
    return best


def inputs_of(dp_segments, seed=1, device=None):
    gen = torch.Generator().manual_seed(seed)
    return [_weights(gen, sum(s), H, device=device) * 4 for s in dp_segments]


@torch.inference_mode()
def run_exact_rank(parallel: Parallel, layers, dp_segments, *, policy="ar", padding="sum_len", sp=False, mode="extend", device=None, **kwargs):
    """One rank's normed rows for its DP set (the stack inputs and weights are the same on every rank)."""
    model = ExactStack(layers, parallel, policy=policy, scheduled=kwargs.pop("scheduled", ()), device=device)
    segments = dp_segments[parallel.attn_dp_rank]
    x = inputs_of(dp_segments, device=device)[parallel.attn_dp_rank]
    counts = tuple(sum(s) for s in dp_segments)
    fwd = Forward(
        parallel, x.shape[0], dp_counts=counts, dp_padding=DpPadding(padding), mode=ForwardMode(mode), sequence_parallel=sp
    )
    return model.run(x, fwd, segments, **kwargs)


@torch.inference_mode()
def reference(layers, dp_segments, **kwargs) -> list:
    """Each DP set's rows on a single rank, without TBO."""
    model = ExactStack(layers, Parallel.single(), scheduled=kwargs.get("scheduled", ()))
    outs = []
    for segments, x in zip(dp_segments, inputs_of(dp_segments)):
        outs.append(model.run(x, Forward(Parallel.single(), x.shape[0]), segments))
    return outs


def split_of(dp_segments) -> tuple:
    """Microbatch 0's rows on every DP rank, at request boundaries."""
    return tuple(balanced_cut(s) for s in dp_segments)
