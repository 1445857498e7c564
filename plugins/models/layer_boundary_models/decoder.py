"""Reference decoder models (Qwen3, Qwen3-MoE, Gemma) written only against the public API,
the way an engine's model author would: each layer declares its two stages once and keeps
its compute; the boundaries do every sum, row move, residual add and norm.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import declare_attn, declare_ffn, layer_stack, make_stages
from layer_boundary import GemmaRMSNorm, RMSNorm
from .attention import DecodeLayout, KernelRope, KVCache, RotaryEmbedding, StaticKVCache, StepLayout, TPAttention
from .config import ConfigError, DecoderConfig
from .lora_layers import LoraGatedMLP, attach_attention_lora
from .mlp import TPGatedMLP
from .moe import TPMoE
from .overlapped import run_layers
from .parts import TwoStageLayer
from .pipeline import enter_stage, leave_stage, place_head, place_stage

__all__ = ["DecoderLayer", "CausalLM"]


def _residuals(config: DecoderConfig, sparse: bool):
    """(attention, FFN) residual ops: FP8 reads where the config asks, for attention and dense
    FFN inputs (a MoE's router and experts keep the plain read)."""
    if config.fp8_reads is None:
        return None, None
    from layer_boundary.plugin import fp8_residual
    from .config import FP8_STATIC_SCALE

    scale = FP8_STATIC_SCALE if config.fp8_reads == "fp8_static" else None
    ops = fp8_residual(config.fp8_reads, static_scale=scale)
    return ops, (None if sparse else ops)


class DecoderLayer(TwoStageLayer):
    def __init__(self, config: DecoderConfig, layer_id: int, parallel, *, fusions=None, lora=None, dtype=None, device=None):
        super().__init__()
        norm = GemmaRMSNorm if config.gemma_norm else RMSNorm
        H = config.hidden_size
        self.layer_id = layer_id
        self.self_attn = TPAttention(config, parallel, layer_id, dtype=dtype, device=device)
        sparse = config.is_sparse(layer_id)
        if sparse:
            self.mlp = TPMoE(config, parallel, dtype=dtype, device=device)
        elif lora is not None:
            self.mlp = LoraGatedMLP(H, config.intermediate_size, parallel.groups["tp"], config.hidden_act, lora, dtype=dtype, device=device)
        else:
            self.mlp = TPGatedMLP(H, config.intermediate_size, parallel.groups["tp"], config.hidden_act, dtype=dtype, device=device)
        self.input_layernorm = norm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = norm(H, config.rms_norm_eps, dtype=dtype, device=device)
        options = {"fusions": fusions} if fusions is not None else {}
        attn_res, ffn_res = _residuals(config, sparse)
        _, prev_ffn_res = _residuals(config, config.is_sparse(layer_id - 1))
        if lora is not None:  # the LoRA layers read which adapter each row of their input uses
            attach_attention_lora(self.self_attn, lora, dtype=dtype, device=device)
            options["publish_rows"] = ("lora",)
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(residual=attn_res, takes_cp_shard=True), self.input_layernorm, {**options, "producer": self.self_attn}),
            (declare_ffn(sparse=sparse, next_sparse=config.is_sparse(layer_id + 1), residual=ffn_res), self.post_attention_layernorm, options),
            previous=declare_ffn(sparse=config.is_sparse(layer_id - 1), next_sparse=sparse, residual=prev_ffn_res) if layer_id else None,
            terminal=layer_id == config.num_layers - 1,
            label=f"layer{layer_id}",
        )


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and a replicated LM head; under pipeline
    parallelism (`topology.pp > 1`) this stage's layers only, the embedding on the first stage
    and the final norm and head on the last (a tied head keeps its own copy there)."""

    def __init__(self, config: DecoderConfig, parallel, *, reduction="ar", fusions=None, lora=None, dtype=None, device=None):
        super().__init__()
        self.lora = lora  # a LoraSpec: every dense layer's projections carry its adapters
        self.lora_seed = 0  # the seed its adapters' weights are drawn from (`load_weights`)
        self.lora_assignment = None  # an adapter slot per request (-1: none), else round-robin
        if lora is not None and config.sparse_layers:
            raise ConfigError("LoRA is supported for dense decoders only; the reference MoE layers have no LoRA")
        place_stage(self, config, parallel, dtype=dtype, device=device)
        H = config.hidden_size
        with layer_stack(parallel, reduction=reduction):
            self.layers = nn.ModuleList(
                DecoderLayer(config, i, parallel, fusions=fusions, lora=lora, dtype=dtype, device=device) for i in self.layer_ids
            )
        final = GemmaRMSNorm if config.gemma_norm or config.gemma_final_norm else RMSNorm
        place_head(self, lambda: final(H, config.rms_norm_eps, dtype=dtype, device=device), dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device) if device is not None else RotaryEmbedding(config.head_dim, config.rope_theta)
        self.handoff_norm = None  # a fusion service that takes a terminal MoE finalize handoff

    def forward_extras(self, step: StepLayout) -> dict:
        """The per-forward facts this model's stages read for `step` (`Forward.extras`): with
        LoRA, the adapter slot of each of this rank's rows (the lora plugin publishes them)."""
        if self.lora is None:
            return {}
        from .lora_layers import LORA_IDS, row_adapter_ids

        count = len(self.lora.adapters)
        slots = [self.lora_assignment[r] if self.lora_assignment is not None else r % count for r in step.rids]
        return {LORA_IDS: row_adapter_ids(slots, step.counts, step.positions.device)}

    def routed_layers(self) -> list:
        """(layer id, router) of every MoE layer this rank holds, for a routing check: each
        router's `choose(scores) -> (choice scores, experts)` picks its layer's experts."""
        return [(layer.layer_id, layer.mlp) for layer in self.layers if isinstance(layer.mlp, TPMoE)]

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def new_static_cache(self, slots: int, max_len: int) -> StaticKVCache:
        """A preallocated cache for CUDA-graph decode (requests live in slots 0..slots-1)."""
        attn = self.layers[0].self_attn
        w = attn.o_proj.weight
        cache = StaticKVCache(self.config.num_layers, slots, max_len, attn.kv_heads, attn.head_dim, dtype=w.dtype, device=w.device)
        cache.rope_table = self.rotary.table(max_len, w.dtype, w.device)
        return cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            h = h * torch.full((), self.config.embed_scale, dtype=h.dtype, device=h.device)
        return h

    def forward(self, input_ids: torch.Tensor, forward, step: StepLayout, cache: Optional[KVCache] = None) -> Optional[torch.Tensor]:
        """Logits [tokens, vocab] for this rank's attention rows; None on an earlier pipeline
        stage (its output went to the next stage)."""
        hidden_states = enter_stage(self, input_ids, forward, step)
        if isinstance(cache, StaticKVCache):
            # the step's cache facts once for every layer; the rotation by a plugin's kernel
            # (prepare_model chose it) or by factors looked up in the cache's table
            attn = self.layers[0].self_attn
            if isinstance(step, DecodeLayout):
                step = cache.bind(step, attn.decode_attention_kernel)
            fused = attn.qk_norm_rope_kernel  # q/k norms and rope in one kernel (replaces both)
            if (attn.rope_kernel is not None or fused is not None) and cache.max_len <= attn.rope_positions:
                table = cache.rope_table if attn.rope_kernel is None else None  # torch rotation if ever called
                rope = KernelRope(attn.rope_kernel, step.positions, fused=fused, table=table)
            else:
                rope = cache.rope(step.positions)
        else:
            rope = self.rotary(step.positions, hidden_states.dtype)
        hidden_states = run_layers(self.layers, hidden_states, forward, step, rope, cache)
        return leave_stage(self, hidden_states, forward, self.norm, handoff_norm=self.handoff_norm)
