"""Which rotary and decode-attention kernels the reference attention runs: chosen once per model.

`prepare_model(model)` (on every rank, before the first forward and any CUDA-graph capture)
asks the `RopeKernel` and `DecodeAttentionKernel` records, in registry order (-priority, name),
with a request built from the model's attention geometry (`RopeRequest`,
`DecodeAttentionRequest`), and chooses as every model-wide kernel kind is chosen
(`kernel_choice.choose`): the first record that *every* rank of the tensor-parallel group
accepts wins, both kinds agreed in one all_reduce, so no two ranks of a model run different
kernels. The torch path (`core.torch`) is always last and never declines; it is what runs
before `prepare_model` and where nothing accepts.

The kernels serve the static-cache path (`new_static_cache`, `static_prefill`,
`static_decode_step`: the CUDA-graph decode an engine runs); the growing per-request cache and
context-parallel prefill keep the torch path. `plan` shows the choice (`describe`).
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from ..plugin import _manager
from ..plugin._requests import DecodeAttentionRequest, RopeRequest
from .kernel_choice import TORCH, KernelChoice, chain, choose, group_of, local_choice, named

__all__ = ["TORCH", "KernelChoice", "AttentionKernels", "prepare_attention_kernels", "release_attention_kernels", "describe", "requests_for"]

#: the default rotary table length when a config names no max_position_embeddings (HF Qwen3's)
DEFAULT_MAX_POSITIONS = 32768


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
    rope, decode = choose([(rope_records, rope_request), (decode_records, decode_request)], group_of(model, first), first.o_proj.weight.device)
    choices = AttentionKernels(rope=rope, decode_attention=decode, max_positions=rope_request.max_positions)
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
    kinds = {"rope": registry.rope_kernels, "decode attention": registry.decode_attention_kernels}
    chosen = model.__dict__.get("attention_kernels") if isinstance(model, torch.nn.Module) else None
    if chosen is not None:
        names = {"rope": named(chosen.rope), "decode attention": named(chosen.decode_attention)}
        where = "agreed across the TP group"
    elif attentions[0].o_proj.weight.device.type == "meta":
        parts = "; ".join(f"{kind}: chain {chain(records)}" for kind, records in kinds.items())
        return f"attention kernels (static cache): chosen on the device at prepare_model; {parts}"
    else:  # this rank's own answer, no agreement (plans do not communicate)
        requests = dict(zip(kinds, requests_for(model, attentions[0])))
        names = {kind: named(local_choice(records, requests[kind])) for kind, records in kinds.items()}
        where = "this rank's answer; prepare_model agrees across the TP group"
    parts = "; ".join(f"{kind}: {names[kind]} (chain {chain(records)})" for kind, records in kinds.items())
    return f"attention kernels (static cache, {where}): {parts}"
