"""A stack of stand-in stages whose arithmetic is exact in float64, for bit-exact parity tests.

Every compute input is rounded to a grid of 1/8 and every weight is a small multiple of 1/8,
so partial products and their sums are exact: however ranks split and order a sum, the result
has the same bits as a single rank's. Norms are the real RMSNorm (in float64), applied to the
same rows on every layout, so any row misplaced, any sum done twice or skipped, any update
applied in the wrong order shows up as a bit difference against `reference()`.

Stage codes:
- "attn": attention (PARTIAL), mixes tokens with a prefix sum, output sum over attention TP;
- "mixer": a SCOPED token mixer (RowParallelLinear honouring the exit's flags);
- "ffn": dense FFN over the TP group on full rows;
- "pffn": the same FFN as a parallel-residual branch of the attention before it;
- "moe": routed experts over EP x TP (may hand its finalize off when asked);
- "tail": a LOCAL_TAIL dense FFN adding a replicated component after its sum.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import torch
from torch import nn

from .._contracts import ProducerReduction, SumGroup
from .._factories import declare_attn, declare_ffn, make_stages
from .._forward import DpPadding, Forward, ForwardMode, get_forward
from .._layers import ColumnParallelLinear, MoeFinalizeHandoff, RowParallelLinear, reduce_output, shard_cols, shard_rows
from .._output import OutputTransform
from .._parallel import Parallel
from .._residual import batch as residual_batch
from .._residual.add_norm import RMSNorm

__all__ = ["GridSpec", "GridModel", "quant", "grid_inputs", "reference", "run_grid_rank"]

STEP = 8.0


def quant(x: torch.Tensor) -> torch.Tensor:
    """Round to the 1/8 grid (exact afterwards in float64 sums of bounded size)."""
    return torch.round(x * STEP) / STEP


def _weights(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=gen, dtype=torch.int64).to(torch.float64) / STEP


@attrs.frozen(kw_only=True)
class GridSpec:
    stages: tuple = ("attn", "ffn", "attn", "ffn")
    hidden: int = 16
    attn_width: int = 16
    ffn_width: int = 32
    experts: int = 4
    top_k: int = 2
    expert_width: int = 16
    seed: int = 0
    #: stage indices whose output gets an OutputTransform (x * 0.5, exact)
    transforms: tuple = ()
    #: group consecutive (attn, ffn) pairs into one make_stages call
    paired: bool = False


class _Stage(nn.Module):
    def __init__(self, code: str, spec: GridSpec, parallel: Parallel, gen: torch.Generator):
        super().__init__()
        self.code = code
        H = spec.hidden
        groups = parallel.groups
        self.norm = RMSNorm(H, 1e-6, dtype=torch.float64, compute_dtype=torch.float64)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + _weights(gen, H))
        if code in ("attn", "mixer"):
            g = groups["attn_tp"]
            self.up = ColumnParallelLinear(H, spec.attn_width, g, dtype=torch.float64)
            self.down = RowParallelLinear(spec.attn_width, H, g, reduce_results=code == "mixer", dtype=torch.float64)
            self.up.load_full(_weights(gen, spec.attn_width, H))
            self.down.load_full(_weights(gen, H, spec.attn_width))
        elif code in ("ffn", "tail", "pffn"):
            g = groups["tp"]
            self.up = ColumnParallelLinear(H, spec.ffn_width, g, dtype=torch.float64)
            self.down = RowParallelLinear(spec.ffn_width, H, g, reduce_results=True, dtype=torch.float64)
            self.up.load_full(_weights(gen, spec.ffn_width, H))
            self.down.load_full(_weights(gen, H, spec.ffn_width))
        elif code == "moe":
            topo = parallel.topology
            self.tp_group = groups["tp"]
            self.router = _weights(gen, spec.experts, H)
            per_rank = spec.experts // topo.moe_ep
            if spec.experts % topo.moe_ep:
                raise ValueError(f"{spec.experts} experts do not split over moe_ep={topo.moe_ep}")
            first = parallel.moe_ep_rank * per_rank
            self.owned = range(first, first + per_rank)
            ups = [_weights(gen, spec.expert_width, H) for _ in range(spec.experts)]
            downs = [_weights(gen, H, spec.expert_width) for _ in range(spec.experts)]
            r, s = parallel.moe_tp_rank, topo.moe_tp
            self.expert_up = {e: shard_rows(ups[e], r, s) for e in self.owned}
            self.expert_down = {e: shard_cols(downs[e], r, s) for e in self.owned}
            self.top_k = spec.top_k
            self.route_weights = torch.tensor([0.75, 0.25, 0.125, 0.0625][: spec.top_k], dtype=torch.float64)
        else:
            raise ValueError(f"unknown grid stage {code!r}")

    def declaration(self, transform: bool):
        t = OutputTransform(lambda x: x * 0.5, name="half") if transform else None
        if self.code == "attn":
            return declare_attn(output_transform=t)
        if self.code == "mixer":
            return declare_attn(reduction=ProducerReduction.SCOPED, output_transform=t)
        if self.code == "tail":
            return declare_ffn(reduction=ProducerReduction.LOCAL_TAIL, output_transform=t)
        return declare_ffn(sparse=self.code == "moe", output_transform=t, parallel_residual=self.code == "pffn")

    def compute(self, h: torch.Tensor) -> torch.Tensor:
        if self.code in ("attn", "mixer"):
            t = self.up(quant(h))
            t = quant(torch.cumsum(t, dim=0) * 0.25)
            return self.down(t)
        if self.code in ("ffn", "tail", "pffn"):
            out = self.down(quant(self.up(quant(h)) * 0.5))
            if self.code == "tail" and get_forward().owns_local_tail:
                out = out + quant(h) * 0.5
            return out
        return self._moe(h)

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        q = quant(h)
        logits = q @ self.router.T
        _, idx = torch.topk(logits, self.top_k, dim=-1)
        rows = q.new_zeros(q.shape[0], self.top_k, q.shape[1])
        for e in self.owned:
            # every owned expert on every token, kept where the router chose it: exact on the grid
            # (zeros elsewhere), with no data-dependent shape, so a compiled region holds it whole
            y = quant((q @ self.expert_up[e].T) * 0.5) @ self.expert_down[e].T
            rows = rows + (idx == e).unsqueeze(-1).to(q.dtype) * y.unsqueeze(1)
        weights = self.route_weights.expand(q.shape[0], -1)
        if get_forward().defer_moe_finalize:
            return MoeFinalizeHandoff(rows, weights, idx, None, self.tp_group, SumGroup.MOE_OUTPUT)
        out = (rows * weights.unsqueeze(-1)).sum(dim=1)
        return reduce_output(out, self.tp_group)


class GridModel(nn.Module):
    """Stages `segment[0]:segment[1]` of `spec.stages` on `parallel` (a pipeline segment when
    not the whole stack)."""

    def __init__(self, spec: GridSpec, parallel: Parallel, *, policy="ar", segment: Optional[tuple] = None, fusions=None):
        super().__init__()
        gen = torch.Generator().manual_seed(spec.seed)
        codes = spec.stages
        self.spec = spec
        # weights of every stage are drawn in order so a segment gets the same ones
        all_stages = [_Stage(c, spec, parallel, gen) for c in codes]
        self.final_norm = RMSNorm(spec.hidden, 1e-6, dtype=torch.float64, compute_dtype=torch.float64)
        with torch.no_grad():
            self.final_norm.weight.copy_(1.0 + _weights(gen, spec.hidden))
        start, end = segment if segment is not None else (0, len(codes))
        self.start, self.end = start, end
        decls = [s.declaration(i in spec.transforms) for i, s in enumerate(all_stages)]
        self.stages = nn.ModuleList(all_stages[start:end])
        opts = {"fusions": fusions} if fusions is not None else None
        boundaries = []
        i = start
        while i < end:
            pair = spec.paired and i + 1 < end and codes[i] in ("attn", "mixer") and codes[i + 1] in ("ffn", "moe", "tail", "pffn")
            n = 2 if pair else 1
            items = [
                (decls[j], all_stages[j].norm) + ((opts,) if opts else ()) for j in range(i, i + n)
            ]
            last = i + n - 1
            boundaries += make_stages(
                *items,
                previous=decls[i - 1] if i > 0 else None,
                following=decls[last + 1] if last + 1 < len(codes) else None,
                terminal=last == len(codes) - 1,
                parallel=parallel,
                reduction=policy,
                label=f"stage{i}",
            )
            i += n
        self.boundaries = boundaries

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == len(self.spec.stages)

    def run(self, h, fwd: Forward, *, captures: Sequence[int] = (), collector: Optional[list] = None, handoff_norm=None,
            transport: str = "replicated"):
        """Run the segment. The first segment starts the stream; a middle one expects
        `h` from `from_pp`; the last returns normed rows, others `to_pp(..., transport=)` tensors."""
        if self.is_first:
            residual_batch.start(fwd)
        for local, (stage, boundary) in enumerate(zip(self.stages, self.boundaries)):
            index = self.start + local
            kwargs = {}
            if index in captures and stage.code in ("attn", "mixer"):
                kwargs["capture_output"] = lambda v, owned=False, _i=index: collector.append((_i, v.clone()))
            x = boundary.prepare(h, fwd, **kwargs)
            if stage.code == "attn":
                h = boundary.finish(stage.compute(x), fwd)
            else:
                with boundary.exit(fwd) as out:
                    y = stage.compute(x)
                h = out.finish(y)
        if self.is_last:
            return residual_batch.norm(h, fwd, self.final_norm, handoff_norm=handoff_norm)
        return residual_batch.to_pp(h, fwd, transport=transport)


def grid_inputs(spec: GridSpec, dp_counts: Sequence[int], seed: int = 1) -> list[torch.Tensor]:
    """Stack inputs (on the grid) of each attention-DP token set."""
    gen = torch.Generator().manual_seed(seed)
    return [_weights(gen, n, spec.hidden) * 4 for n in dp_counts]


@torch.inference_mode()
def reference(spec: GridSpec, inputs: Sequence[torch.Tensor], *, captures: Sequence[int] = ()) -> tuple[list, list]:
    """A single rank's outputs (and captures) for each DP token set, run separately."""
    model = GridModel(spec, Parallel.single())
    outs, caps = [], []
    for x in inputs:
        collector: list = []
        fwd = Forward(Parallel.single(), x.shape[0])
        outs.append(model.run(x, fwd, captures=captures, collector=collector))
        caps.append(collector)
    return outs, caps


@torch.inference_mode()
def run_grid_rank(
    parallel: Parallel,
    spec: GridSpec,
    dp_counts: Sequence[int],
    *,
    policy="ar",
    padding="sum_len",
    variant: Optional[str] = None,
    split: Optional[int] = None,
    captures: Sequence[int] = (),
    fusions=None,
    handoff_norm=None,
    mode: str = "extend",
):
    """One rank's part of a grid run: returns (normed rows of its DP set, captures)."""
    inputs = grid_inputs(spec, dp_counts)
    x = inputs[parallel.attn_dp_rank]
    kwargs = dict(dp_counts=dp_counts, dp_padding=DpPadding(padding), mode=ForwardMode(mode))
    if variant == "sp":
        kwargs["sequence_parallel"] = True
    elif variant == "is":
        kwargs["input_scattered"] = True
    fwd = Forward(parallel, x.shape[0], **kwargs)
    collector: list = []
    if split is None:
        model = GridModel(spec, parallel, policy=policy, fusions=fusions)
        out = model.run(x, fwd, captures=captures, collector=collector, handoff_norm=handoff_norm)
        return out, collector
    first = GridModel(spec, parallel, policy=policy, segment=(0, split), fusions=fusions)
    second = GridModel(spec, parallel, policy=policy, segment=(split, len(spec.stages)), fusions=fusions)
    tensors = first.run(x, fwd, captures=captures, collector=collector)
    fwd2 = Forward(parallel, x.shape[0], **kwargs)
    h = second.boundaries[0].from_pp(tensors, fwd2)
    out = second.run(h, fwd2, captures=captures, collector=collector, handoff_norm=handoff_norm)
    return out, collector
