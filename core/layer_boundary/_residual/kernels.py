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

A plugin's kernel is called through a closure that checks its return against the request
(shape, dtype and device of both outputs: metadata only) and turns a wrong return, or an
exception, into a `FusionError` naming the record, its plugin and the switch that disables it.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import attrs
import torch

from .._errors import FusionError
from .._plugins import manager as _manager
from .._plugins.requests import AddNormRequest
from .._plugins.results import matches, pair_matches, pair_problem, raised, result_problem
from .._plugins.selection import Answer, Selection, select

__all__ = ["TORCH", "Choice", "choose", "choose_norm", "choices_of", "first_call", "first_norm_call", "forget", "chain",
           "OUTPUTS", "kernel_who", "checked_pair"]

#: the name of the norm's own torch path in plans and choices
TORCH = "core.torch"
#: what an add + norm kernel returns, in messages
OUTPUTS = ("normed output", "new residual")


def kernel_who(source: str, what: str = "add + norm") -> str:
    """A chosen record (`Answer.source`) as messages name it: "add + norm kernel record ...";
    `what` is "norm" for a plain norm, "post-norm + add + norm" for a post-norm completion."""
    return f"{what} kernel {source}"

#: norms holding cached choices, emptied when the registry is forgotten
_NORMS: "weakref.WeakSet" = weakref.WeakSet()
#: request -> the `Selection` that answered it: norms with equal facts share one answer
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
    #: the plugin of the chosen record (None: the norm's own torch path)
    plugin: Optional[str] = None
    #: the selection that made the choice (its declines carry their reasons); None when no record was asked
    selection: Optional[Selection] = attrs.field(default=None, eq=False, repr=False)


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


def checked_pair(kernel: Callable, parameters: Callable[[], tuple], who: str, plugin: Optional[str]) -> Callable:
    """`(contribution, residual) -> kernel(contribution, residual, *parameters())`, its return
    checked for a (normed, new residual) pair and its exceptions named (`who`, `plugin`).
    `parameters` is read at each call: a norm's weights may be swapped after the choice."""

    def run(contribution, residual):
        try:
            out = kernel(contribution, residual, *parameters())
        except Exception as exc:
            raise raised(who, plugin, exc) from exc
        if not pair_matches(out, residual):
            raise FusionError(pair_problem(out, residual, who, plugin, names=OUTPUTS))
        return out

    return run


def _bound(kernel: Callable, norm, who: str, plugin: Optional[str]) -> Callable:
    """The chosen add + norm with the norm's weight bound in (a LayerNorm's bias too: None
    without one), its return checked."""
    layer = type(norm).norm_kind == "layer"
    return checked_pair(kernel, (lambda: (norm.weight, norm.bias)) if layer else (lambda: (norm.weight,)), who, plugin)


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
    selection = None
    choice = None
    if not reason:
        request = request_for(norm, key[0], key[1], key[-1])
        selection = by_request.get(request)
        if selection is None:
            selection = by_request[request] = _ask(request, plain=plain)
        chosen = selection.chosen
        if chosen is not None:
            who = kernel_who(chosen.source, "norm" if plain else "add + norm")
            run = (_bound_norm if plain else _bound)(chosen.value, norm, who, chosen.plugin)
            choice = Choice(chosen.candidate, run, _names(selection), plugin=chosen.plugin, selection=selection)
    if choice is None:
        run = norm.torch_forward if plain else norm.add_forward
        choice = Choice(TORCH, run, _names(selection), reason, selection=selection)
    choices[key] = choice
    norm.__dict__.setdefault(f"{prefix}_kernels", {})[key] = choice.run
    _NORMS.add(norm)
    return choice


def _names(selection: Optional[Selection]) -> tuple[str, ...]:
    return () if selection is None else tuple(a.candidate for a in selection.declined)


def _ask(request: AddNormRequest, plain: bool = False) -> Selection:
    """The selection of the first record accepting `request` (none: the torch path runs);
    `plain`: asking the records' `norm_factory` (a record without one declines). A record whose
    kernels compute another norm kind is not asked: it declines by its declaration."""
    every = _manager.get_registry().add_norm_kernels
    records = tuple(item for item in every if request.norm_kind in item.record.norm_kinds)
    subject = f"choosing the {'plain norm' if plain else 'add + norm'} of width {request.hidden_size} on {request.device}"
    chosen = select("add_norm_kernels", (request,), records=records, factory="norm_factory" if plain else "factory",
                    subject=subject, check=callable, error_type=TypeError)
    undeclared = tuple(Answer(item.name, item.plugin, item.distribution, reason=f"implements {', '.join(item.record.norm_kinds)}, "
                              f"not {request.norm_kind}") for item in every if request.norm_kind not in item.record.norm_kinds)
    return attrs.evolve(chosen, answers=undeclared + chosen.answers) if undeclared else chosen


def _bound_norm(kernel: Callable, norm, who: str, plugin: Optional[str]) -> Callable:
    """The chosen plain norm with the norm's weight bound in, its return checked."""

    def run(x):
        try:
            out = kernel(x, norm.weight)
        except Exception as exc:
            raise raised(who, plugin, exc) from exc
        if not matches(out, x.shape, x):
            raise FusionError(result_problem(who, plugin, OUTPUTS[0], out, x.shape, x))
        return out

    return run


def choices_of(norm) -> list[tuple[str, tuple, Choice]]:
    """What `norm` has chosen so far: ("add + norm" or "norm", key, choice) per device and
    dtypes it ran (or was prepared) with."""
    out = [("add + norm", key, c) for key, c in norm.__dict__.get("_add_norm_choices", {}).items()]
    out += [("norm", key, c) for key, c in norm.__dict__.get("_norm_choices", {}).items()]
    return out


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
