"""Helpers for running the boundaries under `torch.compile`: a backend that counts what Dynamo
compiled, and the graph-break count of a run.

    backend = CountingBackend("aot_eager")
    step = torch.compile(model, backend=backend, fullgraph=True)
    ...
    backend.graphs, backend.recompiles, graph_breaks()

Everything else a compiled engine needs is already in the boundaries: collectives and fused
kernels are custom ops (`layer_boundary::all_reduce`, ...), the plans are frozen values Dynamo
guards on, and `Forward` is an ordinary argument (see docs/compiled.md).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Union

import torch

from ._graph import COLLECTIVE_OPS, graph_collectives

__all__ = ["CountingBackend", "compile_model", "user_error", "graph_breaks", "reset_graph_breaks", "graph_ops", "graph_collectives", "COLLECTIVE_OPS"]


class CountingBackend:
    """A `torch.compile` backend that records every graph Dynamo hands it, then compiles it with
    `backend` (a name such as "eager", "aot_eager", "inductor", or a backend callable).

    `graphs` counts the graphs compiled (each recompilation and each piece after a graph break
    is one more); `ops` lists, per graph, the targets of its call nodes."""

    def __init__(self, backend: Union[str, Callable] = "eager"):
        self._backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.name = backend if isinstance(backend, str) else getattr(backend, "__name__", "backend")
        self._lock = threading.Lock()
        self.graph_modules: list = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        with self._lock:
            self.graph_modules.append(gm)
        return self._backend(gm, example_inputs)

    @property
    def graphs(self) -> int:
        return len(self.graph_modules)

    def ops(self, index: Optional[int] = None) -> list:
        """The call targets of graph `index` (all graphs, concatenated, when None)."""
        modules = self.graph_modules if index is None else [self.graph_modules[index]]
        return [node.target for gm in modules for node in gm.graph.nodes if node.op == "call_function"]

    def count(self, target) -> int:
        """How many nodes of all graphs call `target` (an op overload packet or a function)."""
        return sum(1 for t in self.ops() if t is target or getattr(t, "overloadpacket", None) is target)

    def reset(self) -> None:
        with self._lock:
            self.graph_modules.clear()

    def __repr__(self) -> str:
        return f"CountingBackend({self.name}, {self.graphs} graphs)"


def graph_breaks() -> int:
    """Graph breaks Dynamo recorded in this process since the last `reset_graph_breaks()`."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def reset_graph_breaks() -> None:
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()


def graph_ops(model_or_fn, *args, **kwargs) -> list:
    """Trace `model_or_fn(*args, **kwargs)` with `fullgraph=True` and return the call targets of
    its one graph (what a compiled engine sees of it); raises where it would break."""
    backend = CountingBackend("eager")
    torch.compile(model_or_fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return backend.ops()


def user_error(error: BaseException) -> Optional[BaseException]:
    """The exception the traced code itself raised, when `error` is Dynamo reporting one
    (under `fullgraph=True` an error raised while tracing, such as a boundary's check, reaches
    the caller as `torch._dynamo.exc.Unsupported`, "Observed exception", whose cause holds
    the original); None for any other error."""
    from torch._dynamo.exc import ObservedException, Unsupported

    if isinstance(error, Unsupported) and isinstance(error.__cause__, ObservedException):
        return error.__cause__
    return None


def compile_model(model_or_fn, **options):
    """`torch.compile(model_or_fn, fullgraph=True, **options)` that keeps the boundary's error
    table: when tracing stops because the traced code raised (bad input caught by a boundary's
    check), the call runs again eagerly, which raises that error with its own type and message.
    Nothing ran yet when tracing stops, so the eager call is the first one. Any other failure is
    Dynamo's own and is raised as it is."""
    options.setdefault("fullgraph", True)
    compiled = torch.compile(model_or_fn, **options)

    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            if user_error(error) is None:
                raise
            out = model_or_fn(*args, **kwargs)  # raises the boundary's own error
            raise RuntimeError(
                "the compiled call raised while tracing but the eager one did not: " + str(user_error(error))
            ) from error
            return out  # pragma: no cover

    call.compiled = compiled
    call.__wrapped__ = model_or_fn
    return call
