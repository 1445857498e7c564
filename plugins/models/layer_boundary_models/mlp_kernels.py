"""Which gated-activation kernel the reference models' gated MLPs run: chosen once per model.

`prepare_model(model)` (on every rank, before the first forward and any CUDA-graph capture)
asks the `GatedActivationKernel` records with a `GatedActivationRequest` per distinct (device,
dtype, activation, width) of the model's `TPGatedMLP`s (a dense MLP and a MoE's shared expert
may differ in width), and chooses as every model-wide kernel kind is chosen
(`kernel_choice.choose`: the first record every rank of the TP group accepts, all requests
agreed in one all_reduce, the torch path last). Every `TPGatedMLP` (and `LoraGatedMLP`, whose
gate/up deltas go into the fused projection's halves first) gets its request's kernel; a MoE's
routed experts keep torch. Before `prepare_model`, and where nothing accepts, the torch code
runs unchanged. `plan` shows the choice (`describe`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from layer_boundary.plugin import GatedActivationRequest, get_registry
from .kernel_choice import KernelChoice, chain, choose, group_of, local_choice, named

__all__ = ["prepare_mlp_kernels", "release_mlp_kernels", "describe", "request_for"]


def _mlps(model) -> list:
    from .mlp import TPGatedMLP

    return [m for m in model.modules() if isinstance(m, TPGatedMLP)] if isinstance(model, torch.nn.Module) else []


def request_for(mlp) -> GatedActivationRequest:
    """The request of one gated MLP, for its weights' device and dtype and this rank's width."""
    w = mlp.gate_up
    return GatedActivationRequest(device=w.device, dtype=w.dtype, activation=mlp.act_kind, intermediate=mlp.local)


def _distinct(mlps) -> list[GatedActivationRequest]:
    """The distinct requests of `mlps`, in module order (the same on every rank of a TP group)."""
    seen: dict[GatedActivationRequest, None] = {}
    for mlp in mlps:
        seen.setdefault(request_for(mlp), None)
    return list(seen)


def prepare_mlp_kernels(model: Any) -> Optional[dict[GatedActivationRequest, KernelChoice]]:
    """Choose (rank-agreed) the gated-activation kernel of every gated MLP of `model`, install
    it, and keep the choices on the model (`model.mlp_kernels`: request -> choice). Collective
    over the TP group when any record is registered: call on every rank."""
    mlps = _mlps(model)
    if not mlps or mlps[0].gate_up.device.type == "meta":
        return None
    records = get_registry().gated_activation_kernels
    requests = _distinct(mlps)
    asks = [("gated_activation_kernels", records, request, f"choosing the gated activation of width {request.intermediate}") for request in requests]
    picked = choose(asks, group_of(model, mlps[0]), mlps[0].gate_up.device)
    choices = dict(zip(requests, picked))
    for mlp in mlps:
        mlp.gated_activation_kernel = choices[request_for(mlp)].kernel
    model.__dict__["mlp_kernels"] = choices
    return choices


def release_mlp_kernels(model: Any) -> None:
    """Back to the torch path (`release_model`)."""
    for mlp in _mlps(model):
        mlp.gated_activation_kernel = None
    if isinstance(model, torch.nn.Module):
        model.__dict__.pop("mlp_kernels", None)


def _width(request: GatedActivationRequest) -> str:
    return f"{request.activation}, width {request.intermediate}"


def describe(model) -> Optional[str]:
    """One line for plans: what the model's gated MLPs run (or would run) for act(gate) * up."""
    mlps = _mlps(model)
    if not mlps:
        return None
    records = get_registry().gated_activation_kernels
    order = chain(records)
    chosen = model.__dict__.get("mlp_kernels") if isinstance(model, torch.nn.Module) else None
    if chosen is not None:
        names, where = {r: named(c) for r, c in chosen.items()}, "agreed across the TP group"
    elif mlps[0].gate_up.device.type == "meta":
        widths = ", ".join(_width(r) for r in _distinct(mlps))
        return f"mlp kernels: gated activation ({widths}) chosen on the device at prepare_model; chain {order}"
    else:  # this rank's own answer, no agreement (plans do not communicate)
        names = {r: named(local_choice("gated_activation_kernels", records, r)) for r in _distinct(mlps)}
        where = "this rank's answer; prepare_model agrees across the TP group"
    parts = "; ".join(f"({_width(r)}): {name}" for r, name in names.items())
    return f"mlp kernels ({where}): gated activation {parts} (chain {order})"
