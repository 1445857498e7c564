"""Which rotary and decode-attention kernels the reference attention runs: chosen once per model.

`prepare_model(model)` (on every rank, before the first forward and any CUDA-graph capture)
asks the `RopeKernel` and `DecodeAttentionKernel` records, in registry order (-priority, name),
with a request built from the model's attention geometry (`RopeRequest`,
`DecodeAttentionRequest`). The first record that *every* rank of the tensor-parallel group
accepts wins: one all_reduce of acceptance flags per kernel kind when the group has more than
one rank, so no two ranks of a model run different kernels. The torch path (`core.torch`) is
always last and never declines; it is what runs before `prepare_model` and where nothing accepts.

The kernels serve the static-cache path (`new_static_cache`, `static_prefill`,
`static_decode_step`: the CUDA-graph decode an engine runs); the growing per-request cache and
context-parallel prefill keep the torch path. `plan` shows the choice (`describe`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs
import torch

from ..plugin import _manager
from ..plugin._requests import DecodeAttentionRequest, RopeRequest

__all__ = ["TORCH", "KernelChoice", "AttentionKernels", "prepare_attention_kernels", "release_attention_kernels", "describe", "requests_for"]

TORCH = "core.torch"

#: the default rotary table length when a config names no max_position_embeddings (HF Qwen3's)
DEFAULT_MAX_POSITIONS = 32768


@attrs.frozen
class KernelChoice:
    """One kind's kernel for a model: its record name, the kernel (None: torch), and the
    records asked before it that some rank declined."""

    name: str
    kernel: Optional[Callable] = None
    declined: tuple[str, ...] = ()


@attrs.frozen
class AttentionKernels:
    """What a model's attention runs: `rope` and `decode_attention` choices, and the limit of
    positions the rope kernel's table covers (a static cache longer than that runs torch rope)."""

    rope: KernelChoice
    decode_attention: KernelChoice
    max_positions: int = 0


def _attentions(model) -> list:
    from .attention import TPAttention

    return [m for m in model.modules() if isinstance(m, TPAttention)] if isinstance(model, torch.nn.Module) else []


def requests_for(model, attention) -> tuple[RopeRequest, DecodeAttentionRequest]:
    """The requests of `attention` (a `TPAttention` of `model`) for its weights' device and dtype."""
    w = attention.o_proj.weight
    config = getattr(model, "config", None)
    hf = getattr(config, "hf", None) or {}
    rope = RopeRequest(
        device=w.device,
        dtype=w.dtype,
        head_dim=attention.head_dim,
        heads=attention.heads,
        kv_heads=attention.kv_heads,
        theta=float(getattr(config, "rope_theta", 10000.0)),
        max_positions=int(hf.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS),
    )
    decode = DecodeAttentionRequest(
        device=w.device, dtype=w.dtype, head_dim=attention.head_dim, heads=attention.heads, kv_heads=attention.kv_heads,
        scaling=float(attention.scaling),
    )
    return rope, decode


def _local(records, request) -> tuple[list[Optional[Callable]], Optional[str]]:
    """Each record's kernel for `request` on this rank (None where it declines), and what went
    wrong (a factory that raised or returned a non-callable), or None. A failure is not raised
    here: prepare agrees on it first, so no rank raises while its peers wait in the agreement."""
    out: list[Optional[Callable]] = []
    for item in records:
        try:
            kernel = item.record.factory(request)
        except Exception as exc:  # noqa: BLE001 - reported after the agreement, on every rank
            return out + [None] * (len(records) - len(out)), f"kernel record {item.name!r} raised {type(exc).__name__}: {exc}"
        if kernel is not None and not callable(kernel):
            return out + [None] * (len(records) - len(out)), f"kernel record {item.name!r} returned {kernel!r}, which is not callable"
        out.append(kernel)
    return out, None


def _agree(flags: list[bool], group, device) -> list[bool]:
    """Per flag: whether every rank of `group` raised it (one all_reduce for all of them; none
    when no record is registered, which is the same on every rank)."""
    if group is None or group.size == 1 or not flags:
        return flags
    tensor = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    total = group.all_reduce(tensor)
    return [int(round(v)) == group.size for v in total.tolist()]


def _first_agreed(records, kernels, agreed=None) -> KernelChoice:
    """The first record whose flag is agreed (`agreed=None`: this rank's own answers)."""
    agreed = [k is not None for k in kernels] if agreed is None else agreed
    for index, (item, kernel, ok) in enumerate(zip(records, kernels, agreed)):
        if ok:
            return KernelChoice(item.name, kernel, tuple(r.name for r in records[:index]))
    return KernelChoice(TORCH, None, tuple(r.name for r in records))


def _named(choice: KernelChoice) -> str:
    return f"{choice.name} ({', '.join(choice.declined)} declined)" if choice.declined else choice.name


def _group_of(model, attention):
    parallel = getattr(model, "parallel", None)
    groups = getattr(parallel, "groups", None)
    return groups["tp"] if groups is not None and "tp" in groups else attention.group


def prepare_attention_kernels(model: Any) -> Optional[AttentionKernels]:
    """Choose (rank-agreed) the rope and decode-attention kernels of every reference attention
    of `model`, install them, and keep the choice on the model (`model.attention_kernels`).
    Collective over the TP group when any record is registered: call on every rank."""
    attentions = _attentions(model)
    if not attentions:
        return None
    registry = _manager.get_registry()
    rope_records, decode_records = registry.rope_kernels, registry.decode_attention_kernels
    first = attentions[0]
    if first.o_proj.weight.device.type == "meta":
        return None
    rope_request, decode_request = requests_for(model, first)
    for other in attentions[1:]:
        if requests_for(model, other) != (rope_request, decode_request):
            raise ValueError("the reference attentions of one model differ in geometry; kernels are chosen once per model")
    group, device = _group_of(model, first), first.o_proj.weight.device
    (rope_kernels, rope_error), (decode_kernels, decode_error) = _local(rope_records, rope_request), _local(decode_records, decode_request)
    error = rope_error or decode_error
    accepted = [k is not None for k in rope_kernels + decode_kernels]
    agreed, all_answered = [], True
    if accepted:  # no record registered (the same on every rank): nothing to agree on
        # the last flag: this rank's records all answered; agreed with the acceptances in one all_reduce
        *agreed, all_answered = _agree(accepted + [error is None], group, device)
    if not all_answered:
        raise RuntimeError(error or "a kernel record failed at prepare_model on another rank of the TP group (its error is raised there)")
    choices = AttentionKernels(
        rope=_first_agreed(rope_records, rope_kernels, agreed[: len(rope_kernels)]),
        decode_attention=_first_agreed(decode_records, decode_kernels, agreed[len(rope_kernels) :]),
        max_positions=rope_request.max_positions,
    )
    for attention in attentions:
        attention.rope_kernel = choices.rope.kernel
        attention.rope_positions = choices.max_positions
        attention.decode_attention_kernel = choices.decode_attention.kernel
    model.__dict__["attention_kernels"] = choices
    return choices


def release_attention_kernels(model: Any) -> None:
    """Back to the torch path (`release_model`: the kernels' buffers go with the plugins')."""
    for attention in _attentions(model):
        attention.rope_kernel = attention.decode_attention_kernel = None
    if isinstance(model, torch.nn.Module):
        model.__dict__.pop("attention_kernels", None)


def describe(model) -> Optional[str]:
    """One line for plans: what the model's attention runs (or would run) for rope and decode."""
    attentions = _attentions(model)
    if not attentions:
        return None
    registry = _manager.get_registry()
    chains = {
        "rope": [r.name for r in registry.rope_kernels] + [TORCH],
        "decode attention": [r.name for r in registry.decode_attention_kernels] + [TORCH],
    }
    chosen = model.__dict__.get("attention_kernels") if isinstance(model, torch.nn.Module) else None
    if chosen is not None:
        names = {"rope": _named(chosen.rope), "decode attention": _named(chosen.decode_attention)}
        where = "agreed across the TP group"
    elif attentions[0].o_proj.weight.device.type == "meta":
        parts = "; ".join(f"{kind}: chain {' > '.join(chain)}" for kind, chain in chains.items())
        return f"attention kernels (static cache): chosen on the device at prepare_model; {parts}"
    else:  # this rank's own answer, no agreement (plans do not communicate)
        rope_request, decode_request = requests_for(model, attentions[0])
        local = {}
        for kind, records, request in (("rope", registry.rope_kernels, rope_request),
                                       ("decode attention", registry.decode_attention_kernels, decode_request)):
            kernels, error = _local(records, request)
            if error is not None:
                raise RuntimeError(error)
            local[kind] = _named(_first_agreed(records, kernels, None))
        names, where = local, "this rank's answer; prepare_model agrees across the TP group"
    parts = "; ".join(f"{kind}: {names[kind]} (chain {' > '.join(chain)})" for kind, chain in chains.items())
    return f"attention kernels (static cache, {where}): {parts}"
