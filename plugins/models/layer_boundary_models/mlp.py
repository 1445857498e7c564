"""The MLPs, tensor-parallel over the TP group (their sums honour the exit's flags): gated, and plain with optional biases."""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import ColumnParallelLinear, RowParallelLinear, linear, shard_rows

__all__ = ["TPGatedMLP", "TPPlainMLP", "activation", "activation_kind", "dense_experts"]


def dense_experts(x) -> bool:
    """Whether an MoE runs every owned expert on every token (keeping each token's chosen rows)
    instead of gathering each expert's tokens: inside a compiled region (a gather's row count
    depends on tensor data, which a graph cannot hold) and under CUDA graph capture."""
    import torch

    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def activation_kind(name: str) -> str:
    """The plugin API's name of an activation (`GATED_ACTIVATIONS`): configs' aliases resolved."""
    activation(name)  # an unsupported name raises here, as at construction
    return "gelu_tanh" if name == "gelu_pytorch_tanh" else name


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
        self.act_kind = activation_kind(act)
        # `kernel(gate_up) -> act(gate) * up` of a `GatedActivationKernel`, chosen once per model
        # by prepare_model (`mlp_kernels`); None: the torch path (two launches on strided halves)
        self.gated_activation_kernel = None

    def load_full(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        r, s = self.group.rank, self.group.size
        with torch.no_grad():
            self.gate_up.copy_(torch.cat((shard_rows(gate, r, s), shard_rows(up, r, s))))
        self.down.load_full(down)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the fused projection's output [tokens, 2 * local]: the plugin kernel
        when one was chosen, else torch on the two halves."""
        kernel = self.gated_activation_kernel
        if kernel is not None:
            return kernel(gate_up)
        gate, up = gate_up.split(self.local, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activate(linear(x, self.gate_up, self)))


class TPPlainMLP(nn.Module):
    """down(act(up(x))), up split by output feature and down by input feature over `group`;
    with `bias`, up's bias is split with it and down's added once (after the sum, or on rank 0
    when the sum is left to the boundary)."""

    def __init__(self, hidden: int, intermediate: int, group, act: str, *, bias: bool = False, reduce_results=True, dtype=None, device=None):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, intermediate, group, bias=bias, dtype=dtype, device=device)
        self.down = RowParallelLinear(intermediate, hidden, group, bias=bias, reduce_results=reduce_results, dtype=dtype, device=device)
        self.act = activation(act)

    def load_full(self, up: torch.Tensor, down: torch.Tensor, up_bias=None, down_bias=None) -> None:
        self.up.load_full(up, up_bias)
        self.down.load_full(down, down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))
