"""The flashinfer plugin's `GatedActivationKernel` "flashinfer.gated_activation": `act(gate) * up`
of the reference models' gated MLP in one FlashInfer launch.

FlashInfer 0.7.2's `silu_and_mul`, `gelu_tanh_and_mul` and `gelu_and_mul` (`flashinfer.activation`,
each `(input, out=None, enable_pdl=None)`) read a row [..., 2 * d] whose first half is the gate
and second half the up projection, compute in fp32 and write a new [..., d] rounded once; the
torch path runs the activation on a strided half, then the multiply (two launches, each rounding).
The kernel indexes rows as contiguous 2 * d elements, so a strided input is copied first (the
fused projection's output never is). Squared ReLU (`relu2`) has no FlashInfer kernel: declined.

The factory declines without CUDA, for dtypes other than bf16/fp16, an activation FlashInfer has
no kernel for, `LAYER_BOUNDARY_FLASHINFER=0`, flashinfer missing, and a first launch that fails
(it runs one now, so FlashInfer's JIT build happens here and not inside a capture). PDL follows
`LAYER_BOUNDARY_FLASHINFER_PDL` (on: FlashInfer's choice for the device; off: never). Under
torch.compile each call is one custom op, `layer_boundary_flashinfer::gated_activation`, with a
fake implementation.
"""

from __future__ import annotations

from typing import Optional

import torch

from .eligibility import first_launch, model_kernel_reason, settings

__all__ = ["FlashInferGatedActivation", "gated_activation_factory", "reason", "FUNCTIONS"]

DTYPES = (torch.bfloat16, torch.float16)
#: the request's activation -> FlashInfer's function of `flashinfer.activation`
FUNCTIONS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul", "gelu": "gelu_and_mul"}


def reason(request) -> Optional[str]:
    """Why the kernel is not asked for `request` (None: it is tried)."""
    return model_kernel_reason(request, DTYPES, None if request.activation in FUNCTIONS else f"activation {request.activation!r}")


def _run(gate_up: torch.Tensor, activation: str, pdl: bool) -> torch.Tensor:
    import flashinfer.activation

    function = getattr(flashinfer.activation, FUNCTIONS[activation])
    return function(gate_up.contiguous(), enable_pdl=None if pdl else False)


class FlashInferGatedActivation:
    """`(gate_up [T, 2 * d]) -> [T, d]`: act(first half) * second half, a new tensor."""

    def __init__(self, activation: str, pdl: bool):
        self.activation = activation
        self.pdl = pdl

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.gated_activation(gate_up, self.activation, self.pdl)
        return _run(gate_up, self.activation, self.pdl)

    def __repr__(self) -> str:
        return f"FlashInferGatedActivation({FUNCTIONS[self.activation]}, pdl={self.pdl})"


def gated_activation_factory(request) -> Optional[FlashInferGatedActivation]:
    """The `GatedActivationKernel` factory: one trial launch of a row of the request's width."""

    def launch():
        kernel = FlashInferGatedActivation(request.activation, settings().launch_with_pdl)
        out = kernel(torch.zeros(1, 2 * request.intermediate, dtype=request.dtype, device=request.device))
        if out.shape != (1, request.intermediate) or out.dtype != request.dtype:
            raise RuntimeError(f"{FUNCTIONS[request.activation]} returned {tuple(out.shape)} {out.dtype}")
        return kernel

    return first_launch("flashinfer.gated_activation", f"{request.activation} {request.dtype}", request.device, launch,
                        declined=reason(request))


# the custom op torch.compile traces -----------------------------------------------------------------


@torch.library.custom_op("layer_boundary_flashinfer::gated_activation", mutates_args=())
def _gated_activation_op(gate_up: torch.Tensor, activation: str, pdl: bool) -> torch.Tensor:
    return _run(gate_up, activation, pdl)


@_gated_activation_op.register_fake
def _(gate_up, activation, pdl):
    return gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
