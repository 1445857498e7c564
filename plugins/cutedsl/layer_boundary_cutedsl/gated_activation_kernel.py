"""The cutedsl plugin's gated activation: the `GatedActivationKernel` record "cutedsl.gated_activation".

`act(gate) * up` of the reference models' gated MLP (silu, gelu_tanh, gelu) in one CuTe DSL launch
whose grid spreads every token's row over d / 1024 CTAs (kernels/gated_activation_dsl.py). It
ranks above FlashInfer's (`Priority.ARCH_SPECIFIC`), whose kernel gives a token one CTA: at
decode batch sizes that is 1-32 CTAs on a 132-SM H200.

The factory declines off CUDA, for dtypes other than bf16/fp16, other activations (relu2),
widths that are not whole 16-byte vectors, nvidia-cutlass-dsl missing, and a compile or first
launch that fails (a warning says why); it compiles and launches once, so a later call may run
inside a CUDA-graph capture. Under torch.compile a call is the custom op
`layer_boundary_cutedsl::gated_activation`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernel_set import model_kernel_reason, trial_factory
from .kernels.gated_activation import ACTIVATIONS, gated_activation, prepare_gated_activation

__all__ = ["CuteGatedActivation", "factory", "reason"]


def reason(request) -> Optional[str]:
    """Why the kernel cannot run `request` (None: it can, once compiled)."""
    if request.activation not in ACTIVATIONS:
        shape = f"activation {request.activation!r}"
    elif request.intermediate <= 0 or request.intermediate % 8:
        shape = f"width {request.intermediate}"
    else:
        shape = None
    return model_kernel_reason(request, shape)


class CuteGatedActivation:
    """`(gate_up [T, 2 * d]) -> [T, d]`: act(first half) * second half, a new tensor."""

    def __init__(self, activation: str):
        self.activation = activation

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_cutedsl.gated_activation(gate_up, self.activation)
        return gated_activation(gate_up, self.activation)

    def __repr__(self) -> str:
        return f"CuteGatedActivation({self.activation})"


def _trial(request) -> CuteGatedActivation:
    prepare_gated_activation(request.dtype, request.activation, request.intermediate, request.device)
    kernel = CuteGatedActivation(request.activation)
    out = kernel(torch.zeros(1, 2 * request.intermediate, dtype=request.dtype, device=request.device))
    if out.shape != (1, request.intermediate):
        raise RuntimeError(f"returned {tuple(out.shape)}")
    return kernel


def factory(request) -> Optional[CuteGatedActivation]:
    """The record's factory: the compiled kernel and one trial launch of a row."""
    return trial_factory("cutedsl.gated_activation", request, reason(request), lambda: _trial(request), f"{request.activation} {request.dtype}")


# the custom op torch.compile traces ---------------------------------------------------------------


@torch.library.custom_op("layer_boundary_cutedsl::gated_activation", mutates_args=())
def _gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_activation(gate_up, activation)


@_gated_activation.register_fake
def _(gate_up, activation):
    return gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
