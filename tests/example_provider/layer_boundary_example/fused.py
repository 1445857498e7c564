"""The provider object and its "kernel".

A vendor replaces `fused_add_rmsnorm` (and the all-reduce before it) with its own kernel; the
rest of this module is the protocol every candidate follows:

- decline (return None) before touching an input or starting a collective;
- decide only from facts every rank of the sum group shares (rows, dtype, the plan), so all
  ranks take the same path and none waits in a collective the others skipped;
- return `(compute_input, new_residual)` equal to the unfused add + RMSNorm.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Optional

import torch

from layer_boundary import FusedMlpInput, boundaries_of

#: rows above which the candidate declines (a stand-in for a kernel's workspace size)
MAX_ROWS_ENV = "LAYER_BOUNDARY_EXAMPLE_MAX_ROWS"
#: a folder; when set, every accepted call appends one line to <folder>/<pid>.calls
TRACE_ENV = "LAYER_BOUNDARY_EXAMPLE_TRACE"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
CANDIDATE_NAME = "example.fused_add_rmsnorm"

#: accepted calls in this process, by (rows, dtype)
CALLS: collections.Counter = collections.Counter()


def fused_add_rmsnorm(contribution, residual, weight, eps: float, compute_dtype=torch.float32):
    """(weight * rmsnorm(c + r), c + r) in one pass: the sum in at least float32, rounded once
    into the new residual; the norm reads the unrounded sum (as fused kernels do)."""
    acc = torch.promote_types(residual.dtype, torch.float32)
    total = contribution.to(acc) + residual.to(acc)
    new_residual = total.to(residual.dtype)
    x = total.to(compute_dtype)
    normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(residual.dtype), new_residual


class FusedAddRMSNorm:
    """Provider with the capabilities `AttentionInputFusion` and `FfnInputFusion`: one consumer
    candidate for attention and FFN inputs."""

    def __init__(self, max_rows: int = 4096, trace_dir: Optional[str] = None):
        self.limit = max_rows  #: the most rows the "kernel" takes (the environment's cap)
        self.max_rows = max_rows  #: this model's workspace, set by prepare_model
        self.trace_dir = trace_dir

    @classmethod
    def from_environment(cls) -> "FusedAddRMSNorm":
        return cls(int(os.environ.get(MAX_ROWS_ENV, "4096")), os.environ.get(TRACE_ENV) or None)

    def attention_input(self, stage):
        # asked once per stage at construction: bind the stage's norm now, not per forward
        run = functools.partial(self.run, stage.norm)
        return (FusedMlpInput(run=run, name=CANDIDATE_NAME, preserves_residual=True),)

    ffn_input = attention_input

    def prepare(self, max_tokens: int) -> None:
        """The model's largest batch (the same value on every rank, so every rank declines alike)."""
        self.max_rows = min(self.limit, max_tokens)

    def release(self) -> None:
        self.max_rows = self.limit

    def run(self, norm, owed, residual, forward):
        partial = owed.partial
        rows, dtype = partial.shape[0], partial.dtype
        if rows > self.max_rows or dtype not in SUPPORTED_DTYPES or residual.dtype != dtype:
            return None  # nothing touched, nothing started: the next candidate runs
        total = owed.group.all_reduce(partial)  # a vendor kernel fuses this with the rest
        self._trace(rows, dtype)
        return fused_add_rmsnorm(total, residual, norm.weight, norm.eps, getattr(norm, "compute_dtype", torch.float32))

    def _trace(self, rows: int, dtype) -> None:
        CALLS[(rows, str(dtype))] += 1
        if self.trace_dir:
            with open(os.path.join(self.trace_dir, f"{os.getpid()}.calls"), "a") as f:
                f.write(f"{rows} {dtype}\n")


def providers_of(model) -> list[FusedAddRMSNorm]:
    """This plugin's providers on a model's stages (each once, in module order)."""
    found = {}
    for boundary in boundaries_of(model) if isinstance(model, torch.nn.Module) else ():
        for provider, _ in boundary.plan.providers:
            if isinstance(provider, FusedAddRMSNorm):
                found.setdefault(id(provider), provider)
    return list(found.values())
