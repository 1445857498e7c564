"""The model-level life cycle: `prepare_flashinfer_fusion(model)` before any CUDA-graph capture,
`shutdown_flashinfer_fusion()` before `torch.distributed.destroy_process_group()`.

Prepare walks the model's stage boundaries (in module order: the same on every rank), groups
the stages whose input the fused kernels can complete by (reduction group, dtype), sizes one
workspace per group for (max tokens, the widest hidden, dtype), creates or reuses it with every
rank agreeing, and binds each stage's candidates to it. Everything a rank can fail at (an
import, its GPU, memory, a missing provider) is agreed across the group before any rendezvous,
so a failure on one rank turns the fusion off on all of them: the unfused path runs instead.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Optional

import attrs
import torch

from layer_boundary import GemmaRMSNorm, RMSNorm, StageBoundary, boundaries_of

from .collectives import wrapped_flashinfer_collectives
from .eligibility import ENABLE_ENV, SUPPORTED_DTYPES, FlashInferSettings, finalize_stage_reason, plain_stage_reason, stage_reason
from .eligibility import settings as _env_settings
from .provider import FlashInferFinalizeFusion, FlashInferFusion
from .workspace import EnsureResult, WorkspaceManager, WorkspaceSpec

__all__ = ["PrepareReport", "prepare_flashinfer_fusion", "shutdown_flashinfer_fusion", "default_manager"]

_DEFAULT: Optional[WorkspaceManager] = None


def default_manager() -> WorkspaceManager:
    """The process's workspaces over FlashInfer (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        from .backend import FlashInferBackend

        _DEFAULT = WorkspaceManager(FlashInferBackend())
    return _DEFAULT


@attrs.frozen
class PrepareReport:
    """What prepare did: per workspace group, which stages were bound, which were skipped."""

    max_tokens: int
    groups: tuple = ()  #: EnsureResult per (group, dtype), in creation order
    bound: tuple = ()  #: labels of stages whose input candidates are bound
    skipped: tuple = ()  #: (label, reason) of stages left to the unfused path
    finalize: tuple = ()  #: labels of MoE FFN stages that hand their finalize to the next input
    finalize_declined: tuple = ()  #: (label, reason) of MoE FFN stages that finalize themselves
    collectives: tuple = ()  #: "name[ranks] dtype" of FlashInferCollectives bound to a workspace

    @property
    def available(self) -> bool:
        return bool(self.groups) and all(g.available for g in self.groups)

    def __str__(self) -> str:
        lines = [f"flashinfer fusion (max_tokens={self.max_tokens}): {len(self.bound)} stage input(s) bound, "
                 f"{len(self.finalize)} MoE finalize handoff(s), {len(self.skipped)} stage(s) unfused"
                 + (f", all-reduce of {', '.join(self.collectives)} on the workspace" if self.collectives else "")]
        for g in self.groups:
            size = f", {g.workspace_bytes / 2**20:.0f} MiB" if g.available else ""
            why = f": {g.reason}" if g.reason else ""
            lines.append(f"  group ranks {list(g.ranks)} {g.dtype}: {g.action}{size}{why}")
        reasons = defaultdict(int)
        for _, reason in self.skipped:
            reasons[reason] += 1
        for reason, n in sorted(reasons.items()):
            lines.append(f"  {n} stage(s) unfused: {reason}")
        declined = defaultdict(int)
        for _, reason in self.finalize_declined:
            declined[reason] += 1
        for reason, n in sorted(declined.items()):
            lines.append(f"  {n} MoE finalize(s) kept in the MoE: {reason}")
        return "\n".join(lines)


@attrs.define
class _Need:
    """A stage input (or a MoE producer) that wants the workspace of (group, dtype)."""

    label: str
    provider: Optional[FlashInferFusion]
    norm: object
    group: object
    hidden: int
    dtype: torch.dtype
    device: object
    local_reason: Optional[str]
    producer: bool = False
    read: object = None
    #: the plain all-reduce before the stage's local norms (`plain_stage_reason`)
    plain: bool = False


def _boundaries(model) -> list:
    if isinstance(model, StageBoundary):
        return [model]
    if isinstance(model, torch.nn.Module):
        return boundaries_of(model)
    items = list(model)
    if not all(isinstance(b, StageBoundary) for b in items):
        raise TypeError("prepare_flashinfer_fusion takes a model (an nn.Module holding StageBoundary objects) or StageBoundary objects")
    return items


def _ours(plan) -> Optional[FlashInferFusion]:
    return next((p for p, _ in plan.providers if isinstance(p, FlashInferFusion)), None)


def _norm_reason(norm, dtype) -> Optional[str]:
    """Uniform facts: the kernels compute exactly this norm (fp32 statistic, gamma in `dtype`)."""
    if type(norm) not in (RMSNorm, GemmaRMSNorm):
        return f"{type(norm).__name__} is not the core's RMSNorm or GemmaRMSNorm"
    if norm.compute_dtype != torch.float32:
        return f"the norm's statistic is computed in {norm.compute_dtype}; the kernels use float32"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} has no FlashInfer fusion workspace"
    return None


def _weight_bias(norm) -> float:
    return float(type(norm).offset)  # 0 for RMSNorm, 1 for Gemma's (1 + w)


def _weight_of(plan):
    """A weight of the stage's norms (the read's, else the arriving post-norm's: an identity read
    has none): its dtype and device are the stage's rows'."""
    for norm in (plan.norm, plan.post_norm):
        weight = getattr(norm, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
    return None


def _collect(boundaries, backend) -> tuple[dict, list, list]:
    needs: dict = defaultdict(list)
    skipped: list = []
    producers: list = []
    for boundary in boundaries:
        plan = boundary.plan
        desc = plan.description
        provider = _ours(plan)
        norm = plan.norm
        if isinstance(provider, FlashInferFinalizeFusion) or (provider is None and finalize_stage_reason(desc) is None):
            producers.append((plan, provider))
        plain = plain_stage_reason(desc) is None  # FlashInfer's plain all-reduce, then the local norms
        weight = _weight_of(plan)
        dtype = getattr(weight, "dtype", None)
        reason = None if plain else stage_reason(desc)
        if reason is None and not plain:
            reason = _norm_reason(norm, dtype)
        if reason is None and dtype not in SUPPORTED_DTYPES:
            reason = f"dtype {dtype} has no FlashInfer fusion workspace"
        if reason is None:
            reason = backend.width_reason(desc.hidden_size, dtype)
        if reason is not None:
            skipped.append((plan.label, reason))
            continue
        local = None
        if provider is None or not (provider.offers_plain if plain else provider.offers_input):
            local = (
                "the flashinfer provider is not attached to this stage on this rank "
                f"(no CUDA or flashinfer, {ENABLE_ENV}=0, or LAYER_BOUNDARY_DISABLE_PLUGINS)"
            )
        if local is None:
            local = backend.placement_reason(weight)
        group = plan.group(desc.incoming_sum)
        needs[(tuple(group.ranks), dtype)].append(
            _Need(plan.label, provider, norm, group, desc.hidden_size, dtype, weight.device, local, read=plan.read, plain=plain)
        )
    return needs, skipped, producers


def _bind(slot, needs: list, limit: int, backend, collectives=()) -> Optional[str]:
    """Bind every need's candidates (and the group's FlashInferCollectives) to `slot`; a reason
    when this rank could not."""
    try:
        cuda = backend.device_type == "cuda"
        for wrapper in collectives:
            wrapper.bind(slot.dtype, backend.bind_plain_all_reduce(slot), max_tokens=slot.spec.max_tokens,
                         hidden=slot.spec.hidden, cuda=cuda)
            slot.bind(wrapper)
        for need in needs:
            if need.producer:
                continue
            norm, provider = need.norm, need.provider
            capped = min(limit, slot.spec.capacity(need.hidden))
            if need.plain:  # the plain all-reduce; the stage's norms run as local kernels
                provider.plain.bind(backend.bind_plain_all_reduce(slot), limit=capped, dtype=need.dtype, hidden=need.hidden,
                                    group=need.group, cuda=cuda)
                slot.bind(provider.plain)
                continue
            gamma, eps, bias = norm.weight.detach(), float(norm.eps), _weight_bias(norm)
            common = dict(limit=capped, dtype=need.dtype, hidden=need.hidden, group=need.group, cuda=cuda)
            fmt = provider.read_format
            if fmt != "plain":  # an FP8-quantizing read
                scale = getattr(need.read, "static_scale", None)
                provider.fp8.bind(backend.bind_all_reduce_fp8(slot, gamma, eps, bias, need.hidden, capped, fmt, scale), **common)
                slot.bind(provider.fp8)
                continue
            provider.all_reduce.bind(backend.bind_all_reduce(slot, gamma, eps, bias, need.hidden, capped), **common)
            slot.bind(provider.all_reduce)
            if provider.takes_handoff and backend.finalize_reason(need.hidden, need.dtype) is None:
                finalize = backend.bind_finalize(slot, gamma, eps, bias, need.hidden, capped)
                if finalize is not None:
                    provider.finalize.bind(finalize, **common)
                    slot.bind(provider.finalize)
        return None
    except Exception as exc:  # noqa: BLE001 - agreed below, then reported
        return f"binding the launchers failed: {type(exc).__name__}: {exc}"


def _enablement_reason(fi_settings: Optional[FlashInferSettings], boundaries, backend, enabled: bool) -> Optional[str]:
    """Why the engine's settings (or the enforce-disable switch) keep this rank unfused."""
    if not enabled:
        return f"{ENABLE_ENV}=0 (enforce-disable)"
    if fi_settings is None or not boundaries:
        return None
    reason = fi_settings.job_reason(boundaries[0].plan.parallel.topology)
    if reason is None:
        device = next((b.plan.norm.weight.device for b in boundaries if getattr(b.plan.norm, "weight", None) is not None), None)
        capability = getattr(backend, "capability", None)
        reason = fi_settings.device_reason(capability(device) if capability is not None else None)
    return reason


def prepare_flashinfer_fusion(
    model, *, max_tokens: Optional[int] = None, manager: Optional[WorkspaceManager] = None,
    settings: Optional[FlashInferSettings] = None, recapture: bool = False,
) -> PrepareReport:
    """Create (or reuse) the fusion workspaces of `model` and bind its stages' candidates.

    Call it on every rank, after the model's weights are on their device and before any
    CUDA-graph capture; calling it again (after moving the model, or with a new limit) reuses or
    rebuilds the workspaces. A rebuild of a workspace a CUDA graph was captured on is refused
    (`WorkspaceCapturedError`) unless `recapture=True` says the engine drops those graphs and
    captures again. `max_tokens` bounds the tokens of a fused batch (default: `settings.max_tokens`,
    else LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS, else 2048); larger batches take the unfused path.
    `settings` (a `FlashInferSettings`, the same on every rank) is the engine's enablement: backend
    auto / trtllm / off, with auto's rules; without it the fusion applies wherever the kernels take
    a stage. LAYER_BOUNDARY_FLASHINFER=0 enforces off, read here. Returns a `PrepareReport` (the
    same on every rank).
    """
    fi_settings = settings
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "prepare_flashinfer_fusion() ran inside a CUDA-graph capture; workspaces rendezvous across ranks, "
            "so call it once after building the model and before capturing"
        )
    if fi_settings is not None and not isinstance(fi_settings, FlashInferSettings):
        raise TypeError(f"settings must be a FlashInferSettings, got {type(fi_settings).__name__}")
    opts = _env_settings()
    if max_tokens is None and fi_settings is not None:
        max_tokens = fi_settings.max_tokens
    limit = opts.max_tokens if max_tokens is None else max_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    boundaries = _boundaries(model)
    # disabled (LAYER_BOUNDARY_FLASHINFER=0): the factory attached no provider, so every group
    # agrees to stay unfused; the agreement still runs, in case one rank alone was disabled
    manager = manager if manager is not None else default_manager()
    backend = manager.backend
    needs, skipped, producers = _collect(boundaries, backend)
    off = _enablement_reason(fi_settings, boundaries, backend, opts.enabled)
    for plan, provider in producers:  # a producer missing on one rank must turn its group off everywhere
        dtype = getattr(getattr(plan.norm, "weight", None), "dtype", None)
        key = (tuple(plan.group(plan.description.output_sum).ranks), dtype)
        if key in needs and plan.description.output_sum is not None:
            local = None if provider is not None else "the flashinfer provider is not attached to a MoE stage on this rank"
            needs[key].append(_Need(plan.label, provider, plan.norm, None, 0, dtype, None, local, producer=True))
    if off is not None:  # every need of this rank: agreed below, so one rank switched off turns its groups off
        for group_needs in needs.values():
            for need in group_needs:
                need.local_reason = need.local_reason or off
    # every setting that changes which kernel a rank launches, compared across each group
    fingerprint = zlib.crc32(repr((limit, opts.enabled, opts.launch_with_pdl, opts.fp32_acc, opts.defer_finalize, opts.algorithm,
                                   fi_settings.fingerprint() if fi_settings is not None else None)).encode())
    results: list[EnsureResult] = []
    bound: list[str] = []
    wrappers = wrapped_flashinfer_collectives(g for b in boundaries for g in b.plan.parallel.groups.values())
    bound_collectives: list[str] = []
    for key in sorted(needs, key=lambda k: (k[0], str(k[1]))):
        group_needs = needs[key]
        first = next(n for n in group_needs if not n.producer)
        spec = WorkspaceSpec(limit, max(n.hidden for n in group_needs if not n.producer), first.dtype)
        local = next((n.local_reason for n in group_needs if n.local_reason), None)
        slot = manager.slot(first.group, first.dtype, first.device)
        result = slot.ensure(spec, local, fingerprint, recapture=recapture)
        if result.available:
            mine = [w for w in wrappers if w.ranks == key[0]]
            failure = _bind(slot, group_needs, limit, backend, mine)
            if not first.group.agree(failure is None):
                slot.release(barrier=True)
                result = attrs.evolve(result, available=False, action="unavailable",
                                      reason=failure or "another rank of the group could not bind its launchers")
            else:
                bound_collectives.extend(f"{w.name}{list(w.ranks)} {str(key[1]).replace('torch.', '')}" for w in mine)
        results.append(result)
        if result.available:
            bound.extend(n.label for n in group_needs if not n.producer)
        else:
            skipped.extend((n.label, f"no workspace: {result.reason}") for n in group_needs if not n.producer)
    _bind_sum_deferral(boundaries, manager, limit, off)
    finalize: list[str] = []
    declined: list[tuple] = []
    for plan, provider in producers:
        if provider is None:
            continue
        provider.disable_finalize()
        desc = plan.description
        dtype = plan.norm.weight.dtype
        group = plan.group(desc.output_sum)
        slot = manager.slots.get((tuple(group.ranks), dtype, group.rank))
        if not (opts.defer_finalize and off is None and finalize_stage_reason(desc) is None and slot is not None and slot.available):
            continue
        # a width or dtype the finalize kernel gets wrong: the MoE combines its rows itself and
        # its sum still meets the fused all-reduce + add + norm at the next input
        why = backend.finalize_reason(desc.hidden_size, dtype)
        if why is not None:
            declined.append((plan.label, why))
            continue
        provider.enable_finalize(min(limit, slot.spec.capacity(desc.hidden_size)))
        slot.bind(provider)
        finalize.append(plan.label)
    return PrepareReport(limit, tuple(results), tuple(bound), tuple(skipped), tuple(finalize), tuple(declined),
                         tuple(bound_collectives))


def _bind_sum_deferral(boundaries, manager, limit: int, off: Optional[str]) -> None:
    """Let every FFN whose sum defers only into a fused consumer (`fused_consumer_only`, LoRA)
    leave it to the next input where the output group's workspace is agreed (the next input's
    candidates run on it); elsewhere it completes its sum itself."""
    for boundary in boundaries:
        plan = boundary.plan
        provider = _ours(plan)
        if provider is None:
            continue
        provider.defer_sum.unbind()
        desc = plan.description
        if off is not None or not plan.fused_consumer_only or desc.output_sum is None or desc.terminal:
            continue
        weight = getattr(plan.norm, "weight", None)
        group = plan.group(desc.output_sum)
        slot = manager.slots.get((tuple(group.ranks), getattr(weight, "dtype", None), group.rank))
        if slot is not None and slot.available:
            provider.defer_sum.limit = min(limit, slot.spec.capacity(desc.hidden_size))
            slot.bind(provider.defer_sum)


def shutdown_flashinfer_fusion(manager: Optional[WorkspaceManager] = None) -> None:
    """Release every workspace on every rank (collective: call it on all ranks, before
    `torch.distributed.destroy_process_group()`; a workspace left alive can hang the exit)."""
    manager = manager if manager is not None else _DEFAULT
    if manager is not None:
        manager.shutdown(barrier=True)
