"""One CuTe DSL fusion service per model: install, prepare, and the terminal finalize.

    service = install_cutedsl_fusion(model, terminal_finalize=True)   # after building the model
    prepare_cutedsl_fusion(model, max_tokens=256)                      # every rank, same value
    ...
    h = residual_batch.norm(h, forward, model.norm, handoff_norm=service)

`install_cutedsl_fusion` finds the model's stages through `layer_boundary.boundaries_of()`, takes
every `CuteDSLFusion` among their providers (`plan.providers`), checks that the fused norms agree
on one epsilon and width, and binds all of them to one `CuteDSLService`. `prepare_cutedsl_fusion`
sizes that service's workspace once (compiles and loads the kernel variants, allocates the
finalized-partial buffer) and agrees over the TP group that the kernels are usable, so every
deferral decision afterwards is the same on every rank.

The service's `finalize(handoff, residual, gamma)` is what `residual_batch.norm(...,
handoff_norm=service)` calls with a terminal `MoeFinalizeHandoff`: finalize, the group's
all-reduce (its `Collectives`, NCCL on GPUs), then the fused add + norm with `gamma` (the final
norm's multiplier as applied, `gemma_weight`). It never declines: tensors the kernels cannot take
go through torch code with the same semantics and the same single all-reduce.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from layer_boundary import StageBoundary, boundaries_of
from layer_boundary.plugin import is_rms_norm

from . import fused_paths, oneshot
from .kernel_set import CUTEDSL_KERNELS, KernelSet, MoeShape
from .provider import CuteDSLFusion

__all__ = [
    "CuteDSLService",
    "install_cutedsl_fusion",
    "prepare_cutedsl_fusion",
    "release_cutedsl_fusion",
    "prepare_model_fusion",
    "services_of",
]


class CuteDSLService:
    """The state the providers of one model share: epsilon, width, TP group, workspace."""

    def __init__(
        self,
        *,
        hidden_size: int,
        rms_epsilon: float,
        group,
        dtype: torch.dtype,
        device,
        top_k: Optional[int] = None,
        shared_expert: Optional[bool] = None,
        weight_offsets=(0.0,),
        terminal_finalize: bool = False,
        kernels: Optional[KernelSet] = None,
        label: str = "model",
        norm_shapes=(),
    ):
        self.hidden_size = int(hidden_size)
        self.rms_epsilon = float(rms_epsilon)
        self.group = group
        self.dtype = dtype
        self.device = torch.device(device)
        self.top_k = top_k
        self.shared_expert = shared_expert
        self.weight_offsets = tuple(sorted(set(weight_offsets) | {0.0}))
        self.terminal_finalize = terminal_finalize
        self.kernels = kernels if kernels is not None else CUTEDSL_KERNELS
        self.label = label
        #: the `NormsShape`s of the stages that owe a post-norm or read with a LayerNorm or the
        #: identity: the one-shot norms variants the workspace compiles
        self.norm_shapes = tuple(sorted(set(norm_shapes), key=lambda s: s.tag))
        #: tokens the workspace holds (None: not prepared; nothing defers until it is)
        self.max_tokens: Optional[int] = None
        #: the kernels are usable on every rank of the group (agreed in prepare)
        self.usable = False
        self._partial: Optional[torch.Tensor] = None
        #: the one-shot all-reduce workspace under TP (oneshot.py), on every rank or on none
        self.oneshot: Optional[oneshot.OneShotWorkspace] = None
        self.oneshot_reason = ""

    # workspace -------------------------------------------------------------------------------
    def _moe_shapes(self) -> list:
        if self.top_k is None:
            return []
        shared = (False, True) if self.shared_expert is None else (self.shared_expert,)
        if self.group.size == 1:
            return [MoeShape(self.top_k, s, True, o) for s in shared for o in self.weight_offsets]
        return [MoeShape(self.top_k, s, False) for s in shared]

    def prepare(self, max_tokens: int) -> None:
        """Compile and load the kernels and size the workspace for up to `max_tokens` tokens per
        forward. A collective over the TP group (the usability vote): call it on every rank, with
        the same `max_tokens`, before capturing CUDA graphs."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int (the most tokens one forward carries), got {max_tokens!r}")
        if self.max_tokens is not None:
            if max_tokens <= self.max_tokens:
                return
            raise RuntimeError(
                f"the CuTe DSL service of {self.label} was prepared for max_tokens={self.max_tokens}; preparing again with "
                f"{max_tokens} would move a workspace CUDA graphs may hold: prepare once with the largest batch"
            )
        ok = self.kernels.available() and self.dtype in self.kernels.dtypes
        error = None
        if ok:
            try:
                self.kernels.prepare(self.dtype, self.hidden_size, self.device, self.weight_offsets, self._moe_shapes())
                if self.group.size > 1:
                    self._partial = torch.empty(max_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
            except Exception as exc:  # noqa: BLE001 - voted on first, then raised
                ok, error, self._partial = False, exc, None
        # the vote comes before any raise: a rank whose kernels failed turns deferral off on every
        # rank, so none is left waiting in a collective the others run elsewhere
        self.usable = self.group.agree(ok)
        self.max_tokens = max_tokens
        if self.usable and self.group.size > 1 and self.kernels.oneshot is not None:  # collective, like the vote
            self.oneshot, self.oneshot_reason = oneshot.create_for_service(self, max_tokens)
        if error is not None:
            raise RuntimeError(f"the CuTe DSL service of {self.label} could not prepare its kernels: {type(error).__name__}: {error}") from error

    def release(self, *, barrier: bool = True) -> None:
        """Give back the one-shot workspace (with `barrier`: a collective, every rank, before the
        process group goes) and the prepared state: nothing defers until `prepare` runs again."""
        ws, self.oneshot = self.oneshot, None
        if ws is not None:
            ws.release(barrier=barrier)
        self.max_tokens = None
        self.usable = False
        self._partial = None

    def supports(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens may defer work to the fused path."""
        return self.usable and self.max_tokens is not None and 0 < tokens <= self.max_tokens

    def partial_buffer(self, residual) -> Optional[torch.Tensor]:
        """Rows of the workspace for a finalized partial of `residual`'s shape, or None."""
        buf = self._partial
        if buf is None or residual.dim() != 2 or residual.shape[0] > buf.shape[0] or residual.shape[1] != buf.shape[1]:
            return None
        if residual.dtype != buf.dtype or residual.device != buf.device:
            return None
        return buf[: residual.shape[0]]

    # the fused operations ----------------------------------------------------------------------
    def finalize(self, handoff, residual, gamma):
        """(normed, new_residual) of a MoE finalize handoff at the final norm: finalize, the
        group's all-reduce, add, norm with `gamma` (the multiplier as applied) and this service's
        epsilon. Never declines."""
        out = oneshot.finalize_add_norm(self.oneshot, handoff, residual, gamma, 0.0, self.rms_epsilon)
        if out is not None:
            return out
        out = fused_paths.finalize_add_norm(
            self.kernels, handoff, residual, gamma, 0.0, self.rms_epsilon, partial_out=self.partial_buffer(residual)
        )
        if out is not None:
            return out
        return fused_paths.unfused_add_norm(handoff.complete(), residual, gamma, self.rms_epsilon)

    def all_reduce_add_rmsnorm(self, owed, residual, gamma):
        """(normed, new_residual) of an `UnreducedOutput`: its all-reduce, then add + norm. Never declines."""
        out = oneshot.all_reduce_add_norm(self.oneshot, owed, residual, gamma, 0.0, self.rms_epsilon)
        if out is not None:
            return out
        out = fused_paths.all_reduce_add_norm(self.kernels, owed, residual, gamma, 0.0, self.rms_epsilon)
        if out is not None:
            return out
        return fused_paths.unfused_add_norm(owed.complete(), residual, gamma, self.rms_epsilon)

    def __repr__(self) -> str:
        prepared = f"max_tokens={self.max_tokens}, usable={self.usable}" if self.max_tokens is not None else "not prepared"
        if self.oneshot is not None:
            prepared += f", one-shot all-reduce up to {self.oneshot.capacity} tokens"
        return (
            f"CuteDSLService({self.label}: hidden={self.hidden_size}, rms_epsilon={self.rms_epsilon}, "
            f"tp={self.group.size}, kernels={self.kernels.name}, {prepared})"
        )


# ---------------------------------------------------------------------------------------------
# install / prepare
# ---------------------------------------------------------------------------------------------


def _held_in_lists(model) -> list:
    """Boundaries a module keeps in a list or tuple attribute (`boundaries_of` reads plain
    attributes only, like a decoder layer's `attn_boundary`)."""
    return [
        b
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, (list, tuple))
        for b in value
        if isinstance(b, StageBoundary)
    ]


def _boundaries(layers_or_model) -> list:
    if isinstance(layers_or_model, StageBoundary):
        found = [layers_or_model]
    elif isinstance(layers_or_model, torch.nn.Module):
        found = boundaries_of(layers_or_model) + _held_in_lists(layers_or_model)
    else:
        found = [b for item in layers_or_model for b in _boundaries(item)]
    out, seen = [], set()
    for b in found:
        if id(b) not in seen:
            seen.add(id(b))
            out.append(b)
    return out


def _cutedsl_providers(boundary) -> list:
    return [p for p, _ in boundary.plan.providers if isinstance(p, CuteDSLFusion)]


def _default_finalize(boundary) -> bool:
    return boundary.plan.declaration.sparse


def install_cutedsl_fusion(
    layers_or_model,
    *,
    terminal_finalize: bool = False,
    final_norm=None,
    rms_epsilon: Optional[float] = None,
    hidden_size: Optional[int] = None,
    top_k: Optional[int] = None,
    shared_expert: Optional[bool] = None,
    can_defer_finalize: Optional[Callable] = None,
    kernels: Optional[KernelSet] = None,
    label: str = "model",
) -> CuteDSLService:
    """Bind every `CuteDSLFusion` of a model's stages to one new `CuteDSLService` and return it.

    `layers_or_model`: a module (its stages are found with `boundaries_of`), or an iterable of
    modules/boundaries. `can_defer_finalize(boundary) -> bool` picks the MoE stages that hand
    their finalize to the next input (default: every sparse FFN). `terminal_finalize=True` lets
    the last MoE hand its finalize to the final norm; pass the returned service as
    `residual_batch.norm(..., handoff_norm=service)` (a model with a `handoff_norm` attribute gets
    it set here). `final_norm` defaults to the model's `norm` attribute. `rms_epsilon`,
    `hidden_size`, `top_k`, `shared_expert` default to what the norms and `model.config` say.
    Raises before changing anything when the stages disagree with one workspace.
    """
    boundaries = _boundaries(layers_or_model)
    pairs = [(b, p) for b in boundaries for p in _cutedsl_providers(b)]
    if not pairs:
        raise ValueError(
            f"install_cutedsl_fusion: no stage of {label} has a CuteDSLFusion provider; build the stages with "
            "fusions=CuteDSLFusion() (or set LAYER_BOUNDARY_CUTEDSL=1 before building the model)"
        )
    model = layers_or_model if isinstance(layers_or_model, torch.nn.Module) else None
    if final_norm is None and model is not None:
        final_norm = getattr(model, "norm", None)
    # the norms the fused paths run: every stage input with a provider, and the final norm
    fused = [(f"stage {b.plan.label}", b.plan.norm) for b, _ in pairs if is_rms_norm(b.plan.norm)]
    # inputs with a post-norm owed, or a LayerNorm or identity read: the one-shot norms variants
    facts = {b.plan.label: oneshot.norms_facts(b.plan, (kernels or pairs[0][1].kernels).norm_compute_dtypes) for b, _ in pairs}
    norm_shapes = {f.shape for f in facts.values() if f is not None}
    if terminal_finalize:
        if not is_rms_norm(final_norm):
            raise ValueError(
                f"install_cutedsl_fusion(terminal_finalize=True) needs the final norm, a core RMSNorm/GemmaRMSNorm "
                f"(pass final_norm=); got {type(final_norm).__name__}"
            )
        fused.append(("the final norm", final_norm))
    if not fused and not norm_shapes:
        raise ValueError(
            f"install_cutedsl_fusion: no stage of {label} with a CuteDSLFusion provider has a core RMSNorm, a LayerNorm or a "
            "post-norm the kernels compute"
        )
    eps = float(rms_epsilon) if rms_epsilon is not None else (float(fused[0][1].eps) if fused else 0.0)
    for where, norm in fused:
        if float(norm.eps) != eps:
            raise ValueError(
                f"{label}: the CuTe DSL fusion compiles one workspace for rms_epsilon={eps}, but a fused norm uses "
                f"{norm.eps} ({where}); give every fused norm the same epsilon, or build that stage without CuteDSLFusion"
            )
    hidden = int(hidden_size) if hidden_size is not None else (fused[0][1].hidden_size if fused else pairs[0][0].plan.hidden_size)
    widths = fused + [(f"stage {b.plan.label}", b.plan) for b, _ in pairs if facts[b.plan.label] is not None]
    for where, norm in widths:
        if norm.hidden_size != hidden:
            raise ValueError(f"{label}: the CuTe DSL workspace is {hidden} wide, but {where} normalizes {norm.hidden_size} features")
    terminal = [b for b, _ in pairs if b.plan.terminal and b.plan.declaration.sparse]
    if terminal_finalize and not terminal:
        raise ValueError(
            f"install_cutedsl_fusion(terminal_finalize=True): the last stage of {label} is not a MoE FFN with a CuteDSLFusion "
            "provider, so there is no terminal finalize to fuse"
        )
    for _, p in pairs:
        if p.service is not None:
            raise RuntimeError(
                f"install_cutedsl_fusion: {p!r} is already installed; a model has one service, install it once"
            )
    config = getattr(model, "config", None)
    if top_k is None and config is not None:
        top_k = getattr(config, "top_k", None) or None
    if shared_expert is None and config is not None and hasattr(config, "shared_expert_intermediate_size"):
        shared_expert = bool(config.shared_expert_intermediate_size)
    plan = pairs[0][0].plan
    weight = fused[0][1].weight if fused else _weight_of(next(f for f in facts.values() if f is not None))
    service = CuteDSLService(
        hidden_size=hidden,
        rms_epsilon=eps,
        group=plan.parallel.groups["tp"],
        dtype=weight.dtype,
        device=weight.device,
        top_k=top_k,
        shared_expert=shared_expert,
        weight_offsets=[float(getattr(type(n), "offset", 0.0)) for _, n in fused],
        terminal_finalize=terminal_finalize,
        kernels=kernels if kernels is not None else pairs[0][1].kernels,
        label=label,
        norm_shapes=norm_shapes,
    )
    choose = can_defer_finalize or _default_finalize
    by_provider: dict = {}
    for b, p in pairs:
        entry = by_provider.setdefault(id(p), (p, []))
        if b.plan.kind.value == "ffn" and choose(b):
            entry[1].append(b.plan)
    for p, plans in by_provider.values():
        p.install(service, finalize_plans=plans, terminal_finalize=terminal_finalize)
    if terminal_finalize and model is not None and hasattr(model, "handoff_norm"):
        model.handoff_norm = service
    return service


def _weight_of(facts) -> torch.Tensor:
    """A weight of a stage's norms (the read's, else its post-norm's): the rows' dtype and device."""
    return (facts.norm if facts.shape.norm != "none" else facts.post_norm).weight


def services_of(model) -> list:
    """The distinct CuTe DSL services installed on a model's stages (and its `handoff_norm`)."""
    found, seen = [], set()
    candidates = [p.service for b in _boundaries(model) for p in _cutedsl_providers(b)]
    candidates.append(getattr(model, "handoff_norm", None))
    for s in candidates:
        if isinstance(s, CuteDSLService) and id(s) not in seen:
            seen.add(id(s))
            found.append(s)
    return found


def prepare_cutedsl_fusion(model, *, max_tokens: int) -> list:
    """Prepare every service installed on `model` for forwards of up to `max_tokens` tokens
    (the largest of: the prefill chunk, the running requests, the CUDA-graph batch sizes). Call it
    on every rank with the same value (it votes over the TP group). Returns the services."""
    services = services_of(model)
    if not services:
        raise RuntimeError("prepare_cutedsl_fusion: no CuTe DSL service is installed on this model; call install_cutedsl_fusion(model) first")
    for s in services:
        s.prepare(max_tokens)
    return services


def release_cutedsl_fusion(model) -> list:
    """Release what `prepare_cutedsl_fusion` made (the one-shot workspaces, the prepared state;
    see `CuteDSLService.release`). Collective: every rank, before the process group is destroyed.
    Returns the services."""
    services = services_of(model)
    for s in services:
        s.release()
    return services


def _terminal_finalize_fits(model, pairs) -> bool:
    """Whether `install_cutedsl_fusion(model, terminal_finalize=True)` applies: a model that takes
    a `handoff_norm`, whose final norm is a core RMSNorm matching the fused stages' epsilon and
    width, and whose last MoE FFN has a provider."""
    norm = getattr(model, "norm", None)
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "handoff_norm") and is_rms_norm(norm)):
        return False
    fused = [b.plan.norm for b, _ in pairs if is_rms_norm(b.plan.norm)]
    if not fused or any(float(n.eps) != float(norm.eps) or n.hidden_size != norm.hidden_size for n in fused):
        return False
    return any(b.plan.terminal and b.plan.declaration.sparse for b, _ in pairs)


def prepare_model_fusion(model, *, max_tokens: int) -> list:
    """The plugin's `layer_boundary_prepare_model`: when `model`'s stages have `CuteDSLFusion`
    providers (`fusions=CuteDSLFusion()`, or LAYER_BOUNDARY_CUTEDSL=1) and no service is
    installed, `install_cutedsl_fusion(model)` (with the terminal finalize where the model takes
    one: `_terminal_finalize_fits`); then `prepare_cutedsl_fusion(model, max_tokens=...)`.
    A model without such providers is left alone. Returns the prepared services."""
    boundaries = _boundaries(model)
    pairs = [(b, p) for b in boundaries for p in _cutedsl_providers(b)]
    if not pairs:
        return []
    if not services_of(model):
        install_cutedsl_fusion(model, terminal_finalize=_terminal_finalize_fits(model, pairs))
    return prepare_cutedsl_fusion(model, max_tokens=max(1, int(max_tokens)))
