"""Capturing a step (a decode forward through the boundaries) in a CUDA graph.

Everything the boundary decides is fixed by the batch facts a captured step was built with, so
a graph replays exactly the collectives and kernels the eager step ran; engines capture one
graph per batch shape. Workspaces (fusion plugins) must exist before capture.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["CapturedStep"]


class CapturedStep:
    """`fn(*static_inputs)` captured once; `replay(*inputs)` copies the inputs into the static
    buffers, replays, and returns the static output (overwritten by the next replay)."""

    def __init__(self, fn: Callable, static_inputs: Sequence[torch.Tensor], *, warmup: int = 3, pool=None):
        self.static_inputs = tuple(static_inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # lazy initialisation (cuBLAS handles, workspaces) outside the graph
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.static_inputs)

    def replay(self, *inputs: torch.Tensor):
        for dst, src in zip(self.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        return self.output
