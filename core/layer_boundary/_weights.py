"""A model built without its weights refuses to run: `mark_unloaded(model, hint)` (a family's
factory calls it) makes its forward raise `UnloadedWeightsError` until weights arrive through a
loader wrapped by `loads_weights`, `model.load_state_dict`, or `mark_loaded(model)` (code that
writes every parameter itself). The refusal is a forward pre-hook removed on load, so a loaded
model, eager or compiled, runs without it. A model on the meta device is left alone (it has no
storage to load into: plans, checkpoint checks).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["UnloadedWeightsError", "mark_unloaded", "mark_loaded", "weights_loaded", "loads_weights"]

_HINT = "_layer_boundary_unloaded"


class UnloadedWeightsError(RuntimeError):
    """A forward of a model whose weights were never loaded (its parameters hold whatever the
    allocator left there)."""


def _refuse_unloaded(module: torch.nn.Module, args) -> None:
    raise UnloadedWeightsError(getattr(module, _HINT, None) or "this model was built without weights; load them before a forward")


def _loaded_by_state_dict(module: torch.nn.Module, incompatible) -> None:
    mark_loaded(module)


def mark_unloaded(model: torch.nn.Module, hint: str) -> torch.nn.Module:
    """Refuse `model`'s forward with `hint` (one line naming how to load its weights) until
    they load; returns `model`. Nothing happens for a model on the meta device."""
    if any(p.is_meta for p in model.parameters()):
        return model
    object.__setattr__(model, _HINT, hint)
    if _refuse_unloaded not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_refuse_unloaded)
        model.register_load_state_dict_post_hook(_loaded_by_state_dict)
    return model


def mark_loaded(model: torch.nn.Module) -> None:
    """`model`'s weights are in place: its forward runs (no hook left on it)."""
    hooks = model._forward_pre_hooks
    for key in [k for k, hook in hooks.items() if hook is _refuse_unloaded]:
        del hooks[key]
    model.__dict__.pop(_HINT, None)


def weights_loaded(model: torch.nn.Module) -> bool:
    """Whether `model` runs: it was never marked unloaded, or its weights have loaded since."""
    return _refuse_unloaded not in model._forward_pre_hooks.values()


def loads_weights(load: Callable) -> Callable:
    """Wrap a family's `load_weights(model, source, ...)`: after it returns, `model` runs."""

    @functools.wraps(load)
    def wrapper(model, *args, **kwargs):
        result = load(model, *args, **kwargs)
        mark_loaded(model)
        return result

    return wrapper
