"""The DeepSeek-V4 reference model: an mHC residual through the boundaries.

Every layer asks for `residual_kind("mhc", ...)` with its two stage mappings (`attn_hc`,
`ffn_hc`) and the model's exit head (`hc_head`); the boundaries then expand the embedding into
`hc_mult` streams at stack entry, compute each stage's coefficients from the complete streams,
collapse them into the stage input, write each stage's completed output back, and contract the
streams through the head before the final norm. The model keeps only its compute (attention,
MoE) and the mapping weights. Without layer-boundary-mhc installed, construction fails naming it.

What is simplified against Hugging Face's DeepseekV4ForCausalLM (parity holds for every config
this parser accepts): compressed attention (CSA / HCA and their indexer) and hash-routed MoE
layers are rejected at config parse; the shared expert is TP-sharded where HF replicates it (the
same sum); mapping weights are kept in at least float32 and norm weights in the model dtype (HF
keeps both in float32 for bfloat16 checkpoints, so bfloat16 runs round differently); the MTP
layers are not built (HF does not build them either).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import declare_attn, declare_ffn, layer_stack, make_stages, residual_batch, residual_kind
from layer_boundary import RMSNorm
from .attention import StepLayout
from .deepseek_v4_attention import DeepseekV4Attention, InterleavedRope, SlidingKVCache
from .deepseek_v4_config import DeepseekV4Config
from .parts import TwoStageLayer
from .pipeline import place_head, place_stage
from .deepseek_v4_moe import DeepseekV4MoE

__all__ = ["HyperConnectionMapping", "DeepseekV4Layer", "DeepseekV4ForCausalLM"]


class HyperConnectionMapping(nn.Module):
    """The weights of one mHC mapping: `fn [rows, n H]`, `base [rows]`, `scale [scales]`.

    Kept in at least float32 (Hugging Face keeps them float32 in bfloat16 models)."""

    def __init__(self, streams: int, hidden: int, rows: int, scales: int, *, dtype=None, device=None):
        super().__init__()
        dtype = torch.promote_types(torch.float32, dtype or torch.get_default_dtype())
        self.fn = nn.Parameter(torch.empty(rows, streams * hidden, dtype=dtype, device=device))
        self.base = nn.Parameter(torch.empty(rows, dtype=dtype, device=device))
        self.scale = nn.Parameter(torch.empty(scales, dtype=dtype, device=device))

    def load(self, src, names: tuple[str, str, str]) -> None:
        with torch.no_grad():
            for param, name in zip((self.fn, self.base, self.scale), names):
                param.copy_(src.require(name).to(dtype=param.dtype, device=param.device))


def mhc_residual(config: DeepseekV4Config, attn, ffn, head):
    return residual_kind(
        "mhc",
        streams=config.hc_mult,
        sinkhorn_iters=config.hc_sinkhorn_iters,
        eps=config.hc_eps,
        rms_eps=config.rms_norm_eps,
        attn=attn,
        ffn=ffn,
        head=head,
    )


class DeepseekV4Layer(TwoStageLayer):
    def __init__(self, config: DeepseekV4Config, layer_id: int, parallel, head, previous, *, fusions=None, dtype=None, device=None):
        super().__init__()
        n, H = config.hc_mult, config.hidden_size
        self.layer_id = layer_id
        self.self_attn = DeepseekV4Attention(config, parallel, layer_id, dtype=dtype, device=device)
        self.mlp = DeepseekV4MoE(config, parallel, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.attn_hc = HyperConnectionMapping(n, H, (2 + n) * n, 3, dtype=dtype, device=device)
        self.ffn_hc = HyperConnectionMapping(n, H, (2 + n) * n, 3, dtype=dtype, device=device)
        self.residual = mhc_residual(config, self.attn_hc, self.ffn_hc, head)
        options = {"fusions": fusions} if fusions is not None else {}
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(residual=self.residual), self.input_layernorm, {**options, "producer": self.self_attn}),
            (declare_ffn(sparse=True, next_sparse=layer_id + 1 < config.num_layers, residual=self.residual), self.post_attention_layernorm, options),
            previous=declare_ffn(sparse=True, next_sparse=True, residual=previous) if previous is not None else None,
            terminal=layer_id == config.num_layers - 1,
            label=f"layer{layer_id}",
        )



class DeepseekV4ForCausalLM(nn.Module):
    """Embedding, mHC decoder layers, the exit head + final norm, and a replicated LM head."""

    def __init__(self, config: DeepseekV4Config, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        place_stage(self, config, parallel, dtype=dtype, device=device)  # one stage: it runs without pipeline stages
        n, H = config.hc_mult, config.hidden_size
        self.hc_head = HyperConnectionMapping(n, H, n, 1, dtype=dtype, device=device)
        layers, previous = [], None
        with layer_stack(parallel, reduction=reduction):
            for i in range(config.num_layers):
                layer = DeepseekV4Layer(config, i, parallel, self.hc_head, previous, fusions=fusions, dtype=dtype, device=device)
                layers.append(layer)
                previous = layer.residual
        self.layers = nn.ModuleList(layers)
        self.exit_read = previous.final_read
        place_head(self, lambda: RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device), dtype=dtype, device=device)
        self.rotary = InterleavedRope(config.rope_head_dim, config.rope_theta)

    def routed_layers(self) -> list:
        """(layer id, router) of every MoE layer this rank holds, for a routing check: each
        router's `choose(scores) -> (choice scores, experts)` picks its layer's experts."""
        return [(layer.layer_id, layer.mlp) for layer in self.layers]

    def new_cache(self) -> SlidingKVCache:
        return SlidingKVCache(self.config.num_layers, self.config.sliding_window)

    def forward(self, input_ids: torch.Tensor, forward, step: StepLayout, cache: Optional[SlidingKVCache] = None) -> torch.Tensor:
        """Logits [tokens, vocab] for this rank's attention rows."""
        residual_batch.start(forward)
        hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary(step.positions, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, forward, step, rope, cache)
        hidden_states = residual_batch.norm(hidden_states, forward, self.norm, final_read=self.exit_read)
        return self.lm_head(hidden_states)
