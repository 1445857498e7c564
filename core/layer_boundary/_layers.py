"""Tensor-parallel building blocks that honour the flags an exit scope publishes.

`RowParallelLinear(reduce_results=True)` all-reduces its output unless the open exit scope
says the boundary owns the sum (`fuse_mlp_allreduce` or `mlp_reduce_scatter`). An attention
output projection is built with `reduce_results=False`: its sum is always the boundary's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ._forward import get_forward
from ._output import HandoffOutput

__all__ = [
    "Linear", "ColumnParallelLinear", "RowParallelLinear", "reduce_output", "MoeFinalizeHandoff", "shard_rows", "shard_cols", "linear",
    "check_partial_producer", "reduces_itself",
]


def linear(x, weight: torch.Tensor, module: Optional[nn.Module] = None) -> torch.Tensor:
    """x W^T for a tensor, or for a quantized input from a quantizing read (`Fp8Input`).

    On CUDA an FP8 input runs an FP8 GEMM (`torch._scaled_mm`) against the weight quantized once
    per tensor (cached on `module`); elsewhere the input is dequantized (the reference path).
    """
    if isinstance(x, torch.Tensor):
        return nn.functional.linear(x, weight)
    if x.data.is_cuda and hasattr(torch, "_scaled_mm"):
        cached = getattr(module, "_fp8_weight", None) if module is not None else None
        if cached is None or cached[0] is not weight:
            from ._residual.quant import quantize_fp8

            wq = quantize_fp8(weight.float(), weight.dtype, weight.float().abs().amax() / 448.0)
            cached = (weight, wq.data.t(), wq.scale.reshape(1, 1))
            if module is not None:
                module._fp8_weight = cached
        _, w8_t, w_scale = cached
        a_scale = x.scale.reshape(-1, 1) if x.per_token else x.scale.reshape(1, 1)
        b_scale = w_scale.expand(1, w8_t.shape[1]).contiguous() if x.per_token else w_scale
        return torch._scaled_mm(x.data, w8_t, scale_a=a_scale.float(), scale_b=b_scale.float(), out_dtype=x.dtype)
    return nn.functional.linear(x.dequantize(weight.dtype), weight)


def shard_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Dim-0 shard of a weight (column-parallel layers: output features)."""
    if weight.shape[0] % size:
        raise ValueError(f"cannot split {weight.shape[0]} output features over {size} ranks")
    n = weight.shape[0] // size
    return weight[rank * n : (rank + 1) * n]


def shard_cols(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Dim-1 shard of a weight (row-parallel layers: input features)."""
    if weight.shape[1] % size:
        raise ValueError(f"cannot split {weight.shape[1]} input features over {size} ranks")
    n = weight.shape[1] // size
    return weight[:, rank * n : (rank + 1) * n]


class Linear(nn.Linear):
    """nn.Linear that also takes a quantized input (`Fp8Input`) from a quantizing read."""

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):  # the exact op of nn.Linear (bias fused into the GEMM)
            return nn.functional.linear(x, self.weight, self.bias)
        y = linear(x, self.weight, self)
        return y if self.bias is None else y + self.bias


def _shard(features: int, name: str, group) -> int:
    """This rank's share of `features` split evenly over `group` (refused when it does not divide)."""
    if features % group.size:
        raise ValueError(f"{name}={features} is not divisible by the {group.name} size {group.size}")
    return features // group.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output features split over `group`; no communication."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False, dtype=None, device=None):
        super().__init__()
        rows = _shard(out_features, "out_features", group)
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device)) if bias else None

    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        with torch.no_grad():
            self.weight.copy_(shard_rows(weight, self.group.rank, self.group.size))
            if self.bias is not None and bias is not None:
                self.bias.copy_(shard_rows(bias[:, None], self.group.rank, self.group.size)[:, 0])

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):  # a plain tensor: the bias fused into the GEMM
            return nn.functional.linear(x, self.weight, self.bias)
        y = linear(x, self.weight, self)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input features split over `group`; the partial products are summed
    over `group` unless `reduce_results=False` or an open exit scope leaves the sum to the
    boundary. A bias is added once: after the sum, or on rank 0 when the sum is left.

    `shard_addend` (a module of this rank's input shard, None by default) adds a further partial
    before the sum, such as a LoRA `B (A_shard x_shard)`: being linear in the shard, it is
    completed by the same single sum, whether compute or the boundary runs it.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False, reduce_results: bool = True, dtype=None, device=None):
        super().__init__()
        columns = _shard(in_features, "in_features", group)
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, columns, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.shard_addend: Optional[nn.Module] = None

    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        with torch.no_grad():
            self.weight.copy_(shard_cols(weight, self.group.rank, self.group.size))
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        if self.shard_addend is not None:
            y = y + self.shard_addend(x)
        reduces = self.reduce_results and not get_forward().skips_reduction
        if reduces:
            y = self.group.all_reduce(y)
        if self.bias is not None and (reduces or self.group.rank == 0):
            y = y + self.bias
        return y


def reduces_itself(module: nn.Module) -> bool:
    """Whether `module` all-reduces its own output over more than one rank: the core's
    `RowParallelLinear(reduce_results=True)`, or an engine's layer that carries the same
    `reduce_results=True` attribute (and, when it says, a `tp_size` over 1)."""
    if isinstance(module, RowParallelLinear):
        return bool(module.reduce_results) and module.group.size > 1
    return getattr(module, "reduce_results", None) is True and getattr(module, "tp_size", 2) > 1


def check_partial_producer(module: nn.Module, *, stage: str = "attention", reduces=reduces_itself) -> None:
    """Raise if a PARTIAL attention's producer sums its own output.

    A PARTIAL attention's boundary always completes the attention-TP sum at the next input, so an
    output projection that all-reduces too is summed twice (values times the group size), silently.
    The guide builds it with `reduce_results=False`. Attention stages given `{"producer": module}`
    run this check at construction; a model calls it for its own modules, passing `reduces` (a
    predicate on a module) for layer types the default (`reduces_itself`) does not know.
    """
    found = [name or type(module).__name__ for name, sub in module.named_modules() if reduces(sub)]
    if found:
        raise ValueError(
            f"{stage} is a PARTIAL attention (its boundary completes the attention-TP sum) but its producer "
            f"{type(module).__name__} reduces its own output in {', '.join(found)}: the sum would run twice; build the "
            "output projection with reduce_results=False"
        )


def reduce_output(output: torch.Tensor, group) -> torch.Tensor:
    """The MoE output reduction: all-reduce over `group` unless the exit leaves the sum."""
    if get_forward().skips_reduction:
        return output
    return group.all_reduce(output)


class MoeFinalizeHandoff(HandoffOutput):
    """An unfinalized MoE output: expert rows per (token, k) still to be weighted and summed.

    `expert_rows[i, k]` is token i's output from its k-th chosen expert (zeros for experts on
    other ranks), `weights[i, k]` the routing weight; `shared` an optional shared-expert partial.
    `complete()` is the MoE's own unfused tail: weighted sum, shared add, all-reduce.
    """

    __slots__ = ("expert_rows", "weights", "indices", "shared", "group", "sum_group")

    def __init__(self, expert_rows, weights, indices, shared, group, sum_group):
        self.expert_rows = expert_rows
        self.weights = weights
        self.indices = indices
        self.shared = shared
        self.group = group
        self.sum_group = sum_group

    @property
    def rows(self) -> int:
        return self.expert_rows.shape[0]

    def finalize_local(self) -> torch.Tensor:
        out = (self.expert_rows * self.weights.unsqueeze(-1).to(self.expert_rows.dtype)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared
        return out

    def complete(self) -> torch.Tensor:
        return self.group.all_reduce(self.finalize_local())
