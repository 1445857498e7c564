"""`CuteDSLFusion`: consumer candidates that finish what a layer owes with the CuTe DSL kernels.

A stage's fusion provider (core/layer_boundary/fusions.py). Its candidates take

- a `MoeFinalizeHandoff` (a deferred MoE finalize): over one rank, one kernel does finalize +
  residual add + RMSNorm; over several, one launch of the one-shot all-reduce kernel when the
  installed service holds a workspace and the batch fits it (oneshot.py), else `moe_finalize`,
  the handoff group's all-reduce, then `fused_add_rmsnorm`;
- an `UnreducedOutput` (a partial sum): the one-shot kernel likewise, else its all-reduce, then
  `fused_add_rmsnorm`;
- at an input that owes an RMS post-norm before the add (Gemma's sandwich, OLMo-2's post-norm) or
  reads with a LayerNorm or the identity: an `UnreducedOutput` through the one-shot norms variant
  (sum, post-norm, add, read norm in one launch) when the service's workspace takes it; else it
  declines, and the core's completion runs the group's all-reduce and then the stage's local
  completion ("cutedsl.local_norms": post-norm + add + norm in one kernel).

Each candidate declines (returns None, touching nothing) unless everything is on the kernels'
device in a dtype they take, with a core RMSNorm computing in fp32 and a supported width, so
the core's unfused candidate still runs everywhere else. The new residual goes to a new tensor.

`install_cutedsl_fusion()` (service.py) binds every provider of a model to one shared
`CuteDSLService`; from then on the deferral decisions are the service's (prepared, batch within
its workspace) and the terminal MoE may hand its finalize to the final norm. A provider that was
never installed still works on its own (`defer_finalize=True` lets its MoE stages defer).
"""

from __future__ import annotations

import functools
from typing import Optional

from layer_boundary import FusedMlpInput
from layer_boundary.plugin import defers_to_next_input

from . import fused_paths, oneshot
from .kernel_set import CUTEDSL_KERNELS, KernelSet, kernels_available

__all__ = ["CuteDSLFusion", "kernels_available"]


def _candidate(provider: "CuteDSLFusion", oneshot_candidate, unfused, norm, owed, residual):
    """One launch of the one-shot kernel when the service's workspace takes `owed` (under TP),
    else `unfused(provider, kernels, owed, residual, gamma, offset, eps)` when the kernels compute
    what `norm` does, else None (decline)."""
    fused = oneshot_candidate(provider.service, norm, owed, residual)
    if fused is not None:
        return fused
    kernels = provider.kernels
    args = fused_paths.norm_args(kernels, norm, residual)
    if args is None:
        return None
    return unfused(provider, kernels, owed, residual, *args)


def _finalize(provider, kernels, owed, residual, gamma, offset, eps):
    service = provider.service
    partial_out = service.partial_buffer(residual) if service is not None else None
    return fused_paths.finalize_add_norm(kernels, owed, residual, gamma, offset, eps, partial_out=partial_out)


def _all_reduce(provider, kernels, owed, residual, gamma, offset, eps):
    return fused_paths.all_reduce_add_norm(kernels, owed, residual, gamma, offset, eps)


#: the candidate at a post-norm, LayerNorm or identity read input
NORMS_NAME = "cutedsl.all_reduce_add_norms"


def all_reduce_add_norms(provider: "CuteDSLFusion", facts, owed, residual, forward=None):
    """Candidate for an `UnreducedOutput` at an input with norms other than one RMSNorm: one
    launch of the one-shot norms variant, or None (decline) without a workspace that takes it."""
    service = provider.service
    return oneshot.all_reduce_add_norms(None if service is None else service.oneshot, owed, residual, facts)


def finalize_add_norm(provider: "CuteDSLFusion", norm, owed, residual, forward=None):
    """Candidate for a `MoeFinalizeHandoff`: (normed, new_residual), or None to decline."""
    return _candidate(provider, oneshot.finalize_candidate, _finalize, norm, owed, residual)


def all_reduce_add_norm(provider: "CuteDSLFusion", norm, owed, residual, forward=None):
    """Candidate for an `UnreducedOutput`: its all-reduce, then the fused add + norm."""
    return _candidate(provider, oneshot.all_reduce_candidate, _all_reduce, norm, owed, residual)


class CuteDSLFusion:
    """Fusion provider of one stage (give a layer's attention and FFN stages the same one; one
    object may also serve every stage of a model).

    `defer_finalize=True` lets the MoE stages it serves return a `MoeFinalizeHandoff` for the next
    input to finalize, before any service is installed. `kernels` replaces the CuTe DSL kernels
    (tests: `testing.reference_kernels()`); an installed service's kernels take precedence.
    """

    def __init__(self, *, defer_finalize: bool = False, kernels: Optional[KernelSet] = None):
        self.defer_finalize = defer_finalize
        self._kernels = kernels
        self.service = None
        #: ids of the FFN plans allowed to defer their finalize (set by install)
        self._finalize_plans: frozenset = frozenset()
        self.terminal_finalize = False

    @property
    def kernels(self) -> KernelSet:
        if self.service is not None:
            return self.service.kernels
        return self._kernels if self._kernels is not None else CUTEDSL_KERNELS

    def install(self, service, *, finalize_plans=(), terminal_finalize: bool = False) -> None:
        """Bind to `service` (install_cutedsl_fusion does this); `finalize_plans`: the FFN stage
        plans of this provider that may hand their finalize to the next input."""
        if self.service is not None and self.service is not service:
            raise RuntimeError(
                f"{self!r} is already installed on another CuTe DSL service; a model shares one service: call "
                "install_cutedsl_fusion once per model"
            )
        self.service = service
        self._finalize_plans = frozenset(id(p) for p in finalize_plans) | self._finalize_plans
        self.terminal_finalize = terminal_finalize

    # consumer candidates ------------------------------------------------------------------------
    def attention_input(self, plan):
        facts = oneshot.norms_facts(plan, self.kernels.norm_compute_dtypes)
        if facts is not None:  # a post-norm owed, or a LayerNorm or identity read: the norms variant
            post = ("rms", "gemma_rms") if facts.shape.post else ()
            return (FusedMlpInput(run=functools.partial(all_reduce_add_norms, self, facts), name=NORMS_NAME, preserves_residual=True,
                                  norm_kinds=("rms", "gemma_rms", "layer", "none"), post_norm_kinds=post),)
        norm = plan.norm
        return (
            FusedMlpInput(
                run=functools.partial(finalize_add_norm, self, norm), handoff=True, name="cutedsl.finalize_add_rmsnorm", preserves_residual=True
            ),
            FusedMlpInput(run=functools.partial(all_reduce_add_norm, self, norm), name="cutedsl.all_reduce_add_rmsnorm", preserves_residual=True),
        )

    ffn_input = attention_input

    # producer decisions (identical on every rank: plan facts, batch facts the TP group shares,
    # and the service's state, which prepare() agrees on over the group) -------------------------
    def _batch_ok(self, fwd) -> bool:
        if not defers_to_next_input(fwd.parallel.topology, fwd.variant) or fwd.num_tokens <= 0:
            return False
        if self.service is not None:
            return self.service.supports(fwd.num_tokens)
        return self.kernels.available()

    def can_defer_finalize(self, plan, forward) -> bool:
        if self.service is None:
            return self.defer_finalize and not plan.terminal and self._batch_ok(forward)
        if id(plan) not in self._finalize_plans or (plan.terminal and not self.terminal_finalize):
            return False
        return self._batch_ok(forward)

    def can_defer_all_reduce(self, plan, forward) -> bool:
        return self._batch_ok(forward)

    def __repr__(self) -> str:
        installed = f", service of {self.service.label}" if self.service is not None else ""
        return f"CuteDSLFusion(defer_finalize={self.defer_finalize}, kernels={self.kernels.name}{installed})"
