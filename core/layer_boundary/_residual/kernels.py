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
from typing import Any, Callable, Optional

import attrs
import torch

from ..plugin import _manager
from ..plugin._requests import AddNormRequest

__all__ = ["TORCH", "Choice", "choose", "choose_norm", "first_call", "first_norm_call", "describe", "forget", "prepare_norms"]

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


def _own_math(norm, plain: bool = False) -> str:
    """Why `norm`'s add + norm (its plain norm when `plain`) is not the one kernels implement, or ""."""
    from .add_norm import GemmaRMSNorm, RMSNorm

    cls = type(norm)
    if not getattr(norm, "kernels", True):
        return "kernels=False"
    if plain and (cls.forward is not RMSNorm.forward or cls.torch_forward is not RMSNorm.torch_forward):
        return f"{cls.__name__} overrides the norm"
    if cls.add_forward is not RMSNorm.add_forward or cls._normalize is not RMSNorm._normalize:
        return f"{cls.__name__} overrides the add + norm"
    if getattr(cls, "scale_as_kernels", False) and cls.offset in (0.0, 1.0):
        return ""  # its own scale is the kernels' (the weight in fp32, one rounding)
    if cls._scale not in (RMSNorm._scale, GemmaRMSNorm._scale) or cls.offset not in (0.0, 1.0):
        return f"{cls.__name__} scales its own way"
    if (cls._scale is GemmaRMSNorm._scale) != (cls.offset == 1.0):
        return f"{cls.__name__} mixes the Gemma scale and offset"
    return ""


def request_for(norm, device: torch.device, dtype: torch.dtype, contribution_dtype: torch.dtype) -> AddNormRequest:
    weight = norm.weight
    offset = float(type(norm).offset)
    return AddNormRequest(
        device=torch.device(device),
        dtype=dtype,
        contribution_dtype=contribution_dtype,
        weight_dtype=weight.dtype,
        hidden_size=int(weight.shape[0]),
        offset=offset,
        eps=float(norm.eps),
        compute_dtype=getattr(norm, "compute_dtype", torch.float32),
        norm_kind="gemma_rms" if offset else "rms",
    )


def _bound(kernel: Callable, norm) -> Callable:
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
    reason = _own_math(norm, plain=plain)
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
    declined: list[str] = []
    for item in _manager.get_registry().add_norm_kernels:
        make = item.record.norm_factory if plain else item.record.factory
        if request.norm_kind not in item.record.norm_kinds:
            make = None  # a kind the record does not declare: its kernels compute another norm
        kernel = make(request) if make is not None else None
        if kernel is None:
            declined.append(item.name)
            continue
        if not callable(kernel):
            raise TypeError(f"add + norm kernel {item.name!r} returned {kernel!r}, which is not callable")
        return item.name, kernel, tuple(declined)
    return TORCH, None, tuple(declined)


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


_manager._ON_RESET.append(forget)


def describe(norm) -> Optional[str]:
    """One line for plans: the chain and what this norm runs for its weight's device and dtype."""
    from .add_norm import is_rms_norm

    if not is_rms_norm(norm):
        return None
    weight = norm.weight
    chain = [item.name for item in _manager.get_registry().add_norm_kernels] + [TORCH]
    if weight.device.type == "meta":
        return f"add + {type(norm).__name__}: chosen per device and dtype at the first call; chain: {' > '.join(chain)}"
    choice = choose(norm, weight.device, weight.dtype, weight.dtype)
    why = f" ({choice.reason})" if choice.reason else (f" ({', '.join(choice.declined)} declined)" if choice.declined else "")
    return (
        f"add + {type(norm).__name__}: {choice.name}{why} on {weight.device} {str(weight.dtype).replace('torch.', '')}; "
        f"chain: {' > '.join(chain)}"
    )


def prepare_norms(model: Any) -> list[tuple[str, str]]:
    """Choose (and so compile or load) the kernels of every RMSNorm in `model` for its weight's
    device and dtype, before the first forward and any CUDA-graph capture: (module name, kernel)
    for the add + norm and ("<module name> (no add)", kernel) for the plain norm."""
    from .add_norm import is_rms_norm

    if not isinstance(model, torch.nn.Module):
        return []
    out = []
    for name, module in model.named_modules():
        if is_rms_norm(module) and module.weight.device.type != "meta":
            w = module.weight
            out.append((name, choose(module, w.device, w.dtype, w.dtype).name))
            out.append((f"{name} (no add)", choose_norm(module, w.device, w.dtype).name))
    return out
