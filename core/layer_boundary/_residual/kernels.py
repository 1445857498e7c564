"""Local add + RMSNorm kernels: which one a norm runs, chosen once per device and dtypes.

A plain add + RMSNorm read that no fusion provider takes (TP=1 where nothing is owed, after an
unfused all-reduce, the final norm, Gemma norms) calls `RMSNorm.fused_add_forward`. Its first
call on a (device, residual dtype, contribution dtype) asks the `AddNormKernel` records in
registry order (-priority, name) with an `AddNormRequest`; the first factory that returns a
kernel wins and is cached on the norm, so every later call costs one dict lookup. When none
accepts (a CPU tensor, fp32, a width no kernel has, no GPU plugin installed) the norm's own
torch `add_forward` runs: the torch path is always last and never declines.

The choice is per rank and changes no collective, so ranks may differ (one rank's library
failing to load costs it speed, not agreement). It is forgotten when the registry is (a plugin
installed or disabled, `reset_registry()`) and when the norm moves (`.to()`, `.half()`).
A norm built with `kernels=False`, or whose class overrides the math, always runs torch.
"""

from __future__ import annotations

import weakref
from typing import Callable

import attrs
import torch

from .._plugins import manager as _manager
from .._plugins.requests import AddNormRequest
from .._plugins.selection import select

__all__ = ["TORCH", "Choice", "choose", "choose_norm", "first_call", "first_norm_call", "forget", "chain"]

#: the name of the norm's own torch path in plans and choices
TORCH = "core.torch"

#: norms holding cached choices, emptied when the registry is forgotten
_NORMS: "weakref.WeakSet" = weakref.WeakSet()
#: request -> (record name, kernel, declined names): norms with equal facts share one answer
_BY_REQUEST: dict = {}
#: the same for plain norms (`norm_factory`)
_BY_NORM_REQUEST: dict = {}


@attrs.frozen
class Choice:
    """The kernel a norm runs for one key, and why."""

    name: str
    #: `(contribution, residual) -> (normed, new_residual)`, the norm's weight bound in
    run: Callable
    #: the records asked before it that declined, in order
    declined: tuple[str, ...] = ()
    #: why no kernel was asked (`kernels=False`, the norm's own math), or ""
    reason: str = ""


def compute_dtype_of(norm, dtype: torch.dtype) -> torch.dtype:
    """The dtype `norm` computes its statistic in for rows of `dtype` (a LayerNorm built with
    `compute_dtype=None` computes in the wider of the rows' dtype and fp32)."""
    compute = getattr(norm, "compute_dtype", torch.float32)
    return torch.promote_types(dtype, torch.float32) if compute is None else compute


def request_for(norm, device: torch.device, dtype: torch.dtype, contribution_dtype: torch.dtype) -> AddNormRequest:
    weight = norm.weight
    offset = float(type(norm).offset)
    kind = type(norm).norm_kind
    return AddNormRequest(
        device=torch.device(device),
        dtype=dtype,
        contribution_dtype=contribution_dtype,
        weight_dtype=weight.dtype,
        hidden_size=int(weight.shape[-1]),
        offset=offset,
        eps=float(norm.eps),
        compute_dtype=compute_dtype_of(norm, dtype),
        norm_kind=kind if kind == "layer" else ("gemma_rms" if offset else "rms"),
        bias=getattr(norm, "bias", None) is not None,
    )


def _bound(kernel: Callable, norm) -> Callable:
    if type(norm).norm_kind == "layer":  # a LayerNorm's kernel takes its bias (None without one)
        def run_layer(contribution, residual):
            return kernel(contribution, residual, norm.weight, norm.bias)

        return run_layer

    def run(contribution, residual):
        return kernel(contribution, residual, norm.weight)

    return run


def choose(norm, device: torch.device, dtype: torch.dtype, contribution_dtype: torch.dtype) -> Choice:
    """The choice for this key (asking the records when none is cached)."""
    return _choose(norm, (torch.device(device), dtype, contribution_dtype), plain=False)


def _choose(norm, key: tuple, plain: bool) -> Choice:
    """The add + norm's choice for (device, dtype, contribution dtype), or the plain norm's for
    (device, dtype) when `plain`: cached on the norm, asked of the records once per request."""
    prefix, by_request = ("_norm", _BY_NORM_REQUEST) if plain else ("_add_norm", _BY_REQUEST)
    choices = norm.__dict__.setdefault(f"{prefix}_choices", {})
    choice = choices.get(key)
    if choice is not None:
        return choice
    reason = norm.kernel_refusal(plain=plain)
    declined: tuple = ()
    choice = None
    if not reason:
        request = request_for(norm, key[0], key[1], key[-1])
        answer = by_request.get(request)
        if answer is None:
            answer = by_request[request] = _ask(request, plain=plain)
        name, kernel, declined = answer
        if kernel is not None:
            choice = Choice(name, (_bound_norm if plain else _bound)(kernel, norm), declined)
    if choice is None:
        choice = Choice(TORCH, norm.torch_forward if plain else norm.add_forward, declined, reason)
    choices[key] = choice
    norm.__dict__.setdefault(f"{prefix}_kernels", {})[key] = choice.run
    _NORMS.add(norm)
    return choice


def _ask(request: AddNormRequest, plain: bool = False) -> tuple:
    """(name, kernel, declined) of the first record accepting `request` ((TORCH, None, all) if
    none); `plain`: asking the records' `norm_factory` (a record without one declines)."""
    every = _manager.get_registry().add_norm_kernels
    # a record whose kernels compute another norm kind is not asked (it declines by its declaration)
    records = tuple(item for item in every if request.norm_kind in item.record.norm_kinds)
    undeclared = tuple(item.name for item in every if request.norm_kind not in item.record.norm_kinds)
    subject = f"choosing the {'plain norm' if plain else 'add + norm'} of width {request.hidden_size} on {request.device}"
    chosen = select("add_norm_kernels", (request,), records=records, factory="norm_factory" if plain else "factory",
                    subject=subject, check=callable, error_type=TypeError)
    declined = undeclared + tuple(a.candidate for a in chosen.declined)
    if chosen.chosen is None:
        return TORCH, None, declined
    return chosen.chosen.candidate, chosen.value, declined


def _bound_norm(kernel: Callable, norm) -> Callable:
    def run(x):
        return kernel(x, norm.weight)

    return run


def choose_norm(norm, device: torch.device, dtype: torch.dtype) -> Choice:
    """The plain norm's (no add) choice for this key: the first record whose `norm_factory`
    accepts, else the norm's `torch_forward`."""
    return _choose(norm, (torch.device(device), dtype), plain=True)


def first_norm_call(norm, x):
    """The slow path of `RMSNorm.forward`: choose (never inside a trace or a capture), then run."""
    if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return norm.torch_forward(x)
    return choose_norm(norm, x.device, x.dtype).run(x)


def first_call(norm, contribution, residual):
    """The slow path of `fused_add_forward`: choose (outside torch.compile and CUDA-graph
    capture), then run."""
    if torch.compiler.is_compiling():  # no registry walk inside a trace: the torch path traces
        return norm.add_forward(contribution, residual)
    if residual.is_cuda and torch.cuda.is_current_stream_capturing():
        # a factory compiles, loads and launches: not inside a capture (warm up, or prepare_model,
        # first); this call runs torch and the choice waits for an eager call
        return norm.add_forward(contribution, residual)
    return choose(norm, residual.device, residual.dtype, contribution.dtype).run(contribution, residual)


def forget(norm=None) -> None:
    """Drop the cached choices of `norm` (of every norm and request when None)."""
    if norm is None:
        _BY_REQUEST.clear()
        _BY_NORM_REQUEST.clear()
    for n in [norm] if norm is not None else list(_NORMS):
        for cache in ("_add_norm_kernels", "_add_norm_choices", "_norm_kernels", "_norm_choices"):
            n.__dict__.get(cache, {}).clear()


_manager.on_registry_reset(forget)


def chain(kind: str = "rms") -> list[str]:
    """The names of the add + norm kernels asked for a norm of `kind`, in order, the torch path last."""
    return [item.name for item in _manager.get_registry().add_norm_kernels if kind in item.record.norm_kinds] + [TORCH]
