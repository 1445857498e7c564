"""Which rotary, q/k norm + rotary and decode-attention kernels the reference attention runs:
chosen once per model.

`prepare_model(model)` (on every rank, before the first forward and any CUDA-graph capture)
asks the `RopeKernel`, `DecodeAttentionKernel` and (for attentions with q/k norms, Qwen3's)
`QKNormRopeKernel` records, in registry order (-priority, name), with a request built from the
model's attention geometry (`RopeRequest`, `DecodeAttentionRequest`, `QKNormRopeRequest`), and
chooses as every model-wide kernel kind is chosen (`kernel_choice.choose`): the first record
that *every* rank of the tensor-parallel group accepts wins, all kinds agreed in one
all_reduce, so no two ranks of a model run different kernels. An attention without q/k norms
(or whose norms are not the plain RMSNorm the fused kernel implements) never asks the fused
kind: every rank has the same config, so that is rank-uniform. The torch path (`core.torch`)
is always last and never declines; it is what runs before `prepare_model` and where nothing
accepts.

The kernels serve the static-cache path (`new_static_cache`, `static_prefill`,
`static_decode_step`: the CUDA-graph decode an engine runs); the growing per-request cache and
context-parallel prefill keep the torch path. Where a q/k norm + rope kernel is chosen it runs
in place of both norms and the rope kernel (`TPAttention._project`); a static cache longer than
the rope tables (`max_positions`) runs the torch norms and rotation. `plan` shows the choice
(`describe`).
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from layer_boundary.plugin import DecodeAttentionRequest, QKNormRopeRequest, RopeRequest, get_registry
from .kernel_choice import TORCH, KernelChoice, chain, choose, group_of, local_choice, named

__all__ = ["TORCH", "KernelChoice", "AttentionKernels", "prepare_attention_kernels", "release_attention_kernels", "describe", "requests_for"]

#: the default rotary table length when a config names no max_position_embeddings (HF Qwen3's)
DEFAULT_MAX_POSITIONS = 32768


@attrs.frozen
class AttentionKernels:
    """What a model's attention runs: `rope`, `decode_attention` and `qk_norm_rope` (the q/k
    norms and the rope in one kernel; torch, not asked, for attentions without q/k norms)
    choices, and the limit of positions the rope kernels' tables cover (a static cache longer
    than that runs the torch norms and rope)."""

    rope: KernelChoice
    decode_attention: KernelChoice
    max_positions: int = 0
    qk_norm_rope: KernelChoice = KernelChoice(TORCH)


def _all_attentions(model) -> list:
    from .attention import TPAttention

    return [m for m in model.modules() if isinstance(m, TPAttention)] if isinstance(model, torch.nn.Module) else []


def _attentions(model) -> list:
    """The reference attentions of `model` that take plugin kernels (`plugin_kernels`)."""
    return [m for m in _all_attentions(model) if m.plugin_kernels]


#: the plan line of a model whose attentions keep the torch path
TORCH_ONLY = "attention kernels (static cache): core.torch (soft-capping, sliding windows and per-layer rope bases are outside the kernel requests)"


def fusable_qk_norms(attention) -> bool:
    """Whether `attention` has q/k norms a `QKNormRopeKernel` computes: both the core's plain
    `RMSNorm` (weight, no offset, not `kernels=False`, the statistic in fp32, weights in the
    attention's dtype), one epsilon."""
    from layer_boundary import RMSNorm

    q, k = attention.q_norm, attention.k_norm
    if q is None or k is None:
        return False
    dtype = attention.o_proj.weight.dtype  # the request's: weights of another dtype keep the torch norms
    plain = all(type(n) is RMSNorm and n.kernels and n.compute_dtype == torch.float32 and n.weight.dtype == dtype for n in (q, k))
    return plain and q.eps == k.eps


def requests_for(model, attention) -> tuple[RopeRequest, DecodeAttentionRequest, Optional[QKNormRopeRequest]]:
    """The requests of `attention` (a `TPAttention` of `model`) for its weights' device and dtype:
    rope, decode attention, and q/k norm + rope (None when `fusable_qk_norms` is not)."""
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
    qk_norm_rope = None
    if fusable_qk_norms(attention):
        qk_norm_rope = QKNormRopeRequest(
            device=w.device, dtype=w.dtype, head_dim=attention.head_dim, heads=attention.heads, kv_heads=attention.kv_heads,
            theta=rope.theta, max_positions=rope.max_positions, eps=attention.q_norm.eps,
        )
    return rope, decode, qk_norm_rope


def _kinds(registry, requests) -> dict:
    """Plan label -> (point, records, request, subject) of the kinds an attention asks (q/k norm
    + rope only when it has fusable q/k norms), in the order they are chosen."""
    rope, decode, qk_norm_rope = requests
    kinds = {
        "rope": ("rope_kernels", registry.rope_kernels, rope, "choosing the attention's rope kernel"),
        "decode attention": ("decode_attention_kernels", registry.decode_attention_kernels, decode, "choosing the decode attention"),
    }
    if qk_norm_rope is not None:
        kinds["qk norm + rope"] = ("qk_norm_rope_kernels", registry.qk_norm_rope_kernels, qk_norm_rope, "choosing the q/k norm + rope kernel")
    return kinds


def prepare_attention_kernels(model: Any) -> Optional[AttentionKernels]:
    """Choose (rank-agreed) the rope, decode-attention and q/k norm + rope kernels of every
    reference attention of `model`, install them, and keep the choice on the model
    (`model.attention_kernels`). Collective over the TP group when any record is registered:
    call on every rank."""
    attentions = _attentions(model)
    if not attentions:
        return None
    registry = get_registry()
    first = attentions[0]
    if first.o_proj.weight.device.type == "meta":
        return None
    requests = requests_for(model, first)
    for other in attentions[1:]:
        if requests_for(model, other) != requests:
            raise ValueError("the reference attentions of one model differ in geometry; kernels are chosen once per model")
    # every kind in one choose: one all_reduce of acceptance flags for all of them
    asked = _kinds(registry, requests)
    chosen = dict(zip(asked, choose(list(asked.values()), group_of(model, first), first.o_proj.weight.device)))
    choices = AttentionKernels(
        rope=chosen["rope"], decode_attention=chosen["decode attention"], max_positions=requests[0].max_positions,
        qk_norm_rope=chosen.get("qk norm + rope", KernelChoice(TORCH)),
    )
    for attention in attentions:
        attention.rope_kernel = choices.rope.kernel
        attention.rope_positions = choices.max_positions
        attention.decode_attention_kernel = choices.decode_attention.kernel
        attention.qk_norm_rope_kernel = choices.qk_norm_rope.kernel
    model.__dict__["attention_kernels"] = choices
    return choices


def release_attention_kernels(model: Any) -> None:
    """Back to the torch path (`release_model`: the kernels' buffers go with the plugins')."""
    for attention in _attentions(model):
        attention.rope_kernel = attention.decode_attention_kernel = attention.qk_norm_rope_kernel = None
    if isinstance(model, torch.nn.Module):
        model.__dict__.pop("attention_kernels", None)


def describe(model) -> Optional[str]:
    """One line for plans: what the model's attention runs (or would run) for rope and decode,
    and for the q/k norms + rope where the attention has q/k norms."""
    attentions = _attentions(model)
    if not attentions:
        return TORCH_ONLY if _all_attentions(model) else None
    registry = get_registry()
    kinds = _kinds(registry, requests_for(model, attentions[0]))
    chosen = model.__dict__.get("attention_kernels") if isinstance(model, torch.nn.Module) else None
    if chosen is not None:
        choices = {"rope": chosen.rope, "decode attention": chosen.decode_attention, "qk norm + rope": chosen.qk_norm_rope}
        names = {kind: named(choices[kind]) for kind in kinds}
        where = "agreed across the TP group"
    elif attentions[0].o_proj.weight.device.type == "meta":
        parts = "; ".join(f"{kind}: chain {chain(records)}" for kind, (_, records, _, _) in kinds.items())
        return f"attention kernels (static cache): chosen on the device at prepare_model; {parts}"
    else:  # this rank's own answer, no agreement (plans do not communicate)
        names = {kind: named(local_choice(*ask)) for kind, ask in kinds.items()}
        where = "this rank's answer; prepare_model agrees across the TP group"
    parts = "; ".join(f"{kind}: {names[kind]} (chain {chain(records)})" for kind, (_, records, _, _) in kinds.items())
    return f"attention kernels (static cache, {where}): {parts}"
