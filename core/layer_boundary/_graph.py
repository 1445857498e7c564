"""What a compiled region sees of the objects behind the boundary: one graph node per collective
and per fused kernel, registered with `torch.library`.

A compiler's tracer (Dynamo) cannot trace a process group, a thread barrier or a kernel launch
through a workspace. Each of those becomes a custom op whose arguments are tensors, sizes and one
string, the *graph key* of the Python object that runs it (a `Collectives`, a bound fused
candidate). The key is given once, eagerly, when the object is registered (`register_graph_object`:
`Parallel` registers every group it holds); at run time the op looks the object up by its key and
calls it as eager code does. A fake implementation gives each op's output shapes, so nothing runs
while tracing.

The ops run only inside a compiled region (`torch.compiler.is_dynamo_compiling()`); eager calls go to the
objects directly, as before, and pay nothing for any of this.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Sequence

import torch

__all__ = [
    "register_graph_object",
    "graph_object",
    "graph_key",
    "graph_collectives",
    "COLLECTIVE_OPS",
]

_lock = threading.Lock()
_counter = itertools.count()
_weak: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_strong: dict[str, Any] = {}  # objects that take no weak reference


def register_graph_object(obj, prefix: str) -> str:
    """Give `obj` a graph key (stored on it as `_graph_key`) and make it findable by that key from
    a custom op at run time; returns the key. Registering again returns the same key. Eager
    only: call it where the object is built, never inside a compiled region."""
    key = vars(obj).get("_graph_key") if hasattr(obj, "__dict__") else getattr(obj, "_graph_key", None)
    if key is not None:
        return key
    with _lock:
        key = f"{prefix}#{next(_counter)}"
        try:
            object.__setattr__(obj, "_graph_key", key)
        except AttributeError:
            raise TypeError(
                f"{type(obj).__name__} cannot carry a graph key: give the class a `_graph_key` slot (or a __dict__)"
            ) from None
        try:
            _weak[key] = obj
        except TypeError:  # no __weakref__: keep it alive (a few per model)
            _strong[key] = obj
    return key


def graph_object(key: str):
    """The object registered under `key` (what a custom op's implementation runs)."""
    obj = _weak.get(key)
    if obj is None:
        obj = _strong.get(key)
    if obj is None:
        raise RuntimeError(f"no object is registered under the graph key {key!r} (it was released, or never registered)")
    return obj


def graph_key(obj) -> str:
    """`obj`'s graph key, read from the object itself (traceable); an unregistered object is an
    error that names the fix."""
    # a plain attribute read: Dynamo (torch 2.11) fails inside `hasattr(obj, "__dict__")` on a
    # slotted object, and both kinds store it
    key = getattr(obj, "_graph_key", None)
    if key is None:
        raise RuntimeError(
            f"{obj!r} is used inside a compiled region but was never registered: build groups through Parallel "
            "(it registers each one), or call layer_boundary.plugin.register_graph_object(obj, name) where it is built"
        )
    return key


# ---------------------------------------------------------------------------------------------
# collectives: one op per operation of the Collectives protocol
# ---------------------------------------------------------------------------------------------


def _run(key: str, name: str, x: torch.Tensor, *args):
    # every Collectives operation may consume its input: give it a copy the graph does not hold
    return getattr(graph_object(key), name)(x.clone(), *args)


@torch.library.custom_op("layer_boundary::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _run(group, "all_reduce", x)


@_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("layer_boundary::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    return _run(group, "reduce_scatter", x)


@_reduce_scatter.register_fake
def _(x, group, world):
    return x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))


@torch.library.custom_op("layer_boundary::reduce_scatterv", mutates_args=())
def _reduce_scatterv(x: torch.Tensor, group: str, sizes: Sequence[int], rank: int) -> torch.Tensor:
    return _run(group, "reduce_scatterv", x, tuple(sizes))


@_reduce_scatterv.register_fake
def _(x, group, sizes, rank):
    return x.new_empty((sizes[rank],) + tuple(x.shape[1:]))


@torch.library.custom_op("layer_boundary::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    return _run(group, "all_gather", x)


@_all_gather.register_fake
def _(x, group, world):
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))


@torch.library.custom_op("layer_boundary::all_gatherv", mutates_args=())
def _all_gatherv(x: torch.Tensor, group: str, sizes: Sequence[int]) -> torch.Tensor:
    return _run(group, "all_gatherv", x, tuple(sizes))


@_all_gatherv.register_fake
def _(x, group, sizes):
    return x.new_empty((sum(sizes),) + tuple(x.shape[1:]))


#: the op each Collectives operation becomes inside a compiled region
COLLECTIVE_OPS = {
    "all_reduce": torch.ops.layer_boundary.all_reduce,
    "reduce_scatter": torch.ops.layer_boundary.reduce_scatter,
    "reduce_scatterv": torch.ops.layer_boundary.reduce_scatterv,
    "all_gather": torch.ops.layer_boundary.all_gather,
    "all_gatherv": torch.ops.layer_boundary.all_gatherv,
}


def _graph_all_reduce(method):
    def all_reduce(self, x):
        if torch.compiler.is_dynamo_compiling() and self.size > 1 and not self.graph_native:
            return torch.ops.layer_boundary.all_reduce(x, graph_key(self))
        return method(self, x)

    return all_reduce


def _graph_reduce_scatter(method):
    def reduce_scatter(self, x):
        if torch.compiler.is_dynamo_compiling() and self.size > 1 and not self.graph_native:
            return torch.ops.layer_boundary.reduce_scatter(x, graph_key(self), self.size)
        return method(self, x)

    return reduce_scatter


def _graph_reduce_scatterv(method):
    def reduce_scatterv(self, x, sizes):
        if torch.compiler.is_dynamo_compiling() and self.size > 1 and not self.graph_native:
            return torch.ops.layer_boundary.reduce_scatterv(x, graph_key(self), list(sizes), self.rank)
        return method(self, x, sizes)

    return reduce_scatterv


def _graph_all_gather(method):
    def all_gather(self, x):
        if torch.compiler.is_dynamo_compiling() and self.size > 1 and not self.graph_native:
            return torch.ops.layer_boundary.all_gather(x, graph_key(self), self.size)
        return method(self, x)

    return all_gather


def _graph_all_gatherv(method):
    def all_gatherv(self, x, sizes):
        if torch.compiler.is_dynamo_compiling() and self.size > 1 and not self.graph_native:
            return torch.ops.layer_boundary.all_gatherv(x, graph_key(self), list(sizes))
        return method(self, x, sizes)

    return all_gatherv


_WRAPPERS = {
    "all_reduce": _graph_all_reduce,
    "reduce_scatter": _graph_reduce_scatter,
    "reduce_scatterv": _graph_reduce_scatterv,
    "all_gather": _graph_all_gather,
    "all_gatherv": _graph_all_gatherv,
}


def graph_collectives(cls):
    """Class decorator for a `Collectives` implementation: inside a compiled region each of its
    operations on a group of more than one rank becomes one `layer_boundary::<operation>` node
    whose run-time implementation calls this object's method, eagerly, with the same arguments.

    Use it on an engine's own Collectives whose operations a tracer cannot follow (a custom
    all-reduce over raw pointers, a communicator of its own). An implementation that is
    traceable as it is (written with `torch.distributed._functional_collectives` or with ops the
    engine registered itself) sets `graph_native = True` (per instance or class) and is traced
    directly. Groups reach a compiled region registered: `Parallel` registers every group it
    holds (`register_graph_object`).
    """
    for name, wrap in _WRAPPERS.items():
        method = cls.__dict__.get(name)
        if method is None or getattr(method, "__wrapped__", None) is not None:
            continue
        wrapper = wrap(method)
        wrapper.__wrapped__ = method
        wrapper.__name__ = wrapper.__qualname__ = method.__name__
        wrapper.__doc__ = method.__doc__
        setattr(cls, name, wrapper)
    if "graph_native" not in vars(cls) and not hasattr(cls, "graph_native"):
        cls.graph_native = False
    return cls
