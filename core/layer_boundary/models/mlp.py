"""The gated MLP, tensor-parallel over the TP group (its sum honours the exit's flags)."""

from __future__ import annotations

import torch
from torch import nn

from .._layers import RowParallelLinear, linear, shard_rows

__all__ = ["TPGatedMLP", "activation", "dense_experts"]


def dense_experts(x) -> bool:
    """Whether an MoE runs every owned expert on every token (keeping each token's chosen rows)
    instead of gathering each expert's tokens: inside a compiled region (a gather's row count
    depends on tensor data, which a graph cannot hold) and under CUDA graph capture."""
    import torch

    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def activation(name: str):
    if name == "silu":
        return nn.functional.silu
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return lambda x: torch.square(nn.functional.relu(x))
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: nn.functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return nn.functional.gelu
    raise ValueError(f"hidden_act {name!r} is not supported by the reference models")


class TPGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up split by output feature, down by input feature."""

    def __init__(self, hidden: int, intermediate: int, group, act: str, *, reduce_results=True, dtype=None, device=None):
        super().__init__()
        self.group = group
        local = intermediate // group.size
        self.local = local
        self.gate_up = nn.Parameter(torch.empty(2 * local, hidden, dtype=dtype, device=device))
        self.down = RowParallelLinear(intermediate, hidden, group, reduce_results=reduce_results, dtype=dtype, device=device)
        self.act = activation(act)

    def load_full(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        r, s = self.group.rank, self.group.size
        with torch.no_grad():
            self.gate_up.copy_(torch.cat((shard_rows(gate, r, s), shard_rows(up, r, s))))
        self.down.load_full(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up, self).split(self.local, dim=-1)
        return self.down(self.act(gate) * up)
