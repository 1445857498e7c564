"""The Gemma 2 and Gemma 3 (text) reference models: sandwich-norm decoders written against the
public API.

Each sublayer sits between two (1 + w) RMSNorms: `h + post_norm(attn(pre_norm(h)))`, then the
same around the MLP. The post-norm needs the sublayer's complete output (after its TP sum), so
each stage declares it as its `output_transform`: the boundary completes the sum, applies the
post-norm, adds the residual and prepares the next stage's pre-norm. Sliding-window and full
attention layers alternate (`layer_types`); Gemma 2 soft-caps attention scores and the final
logits, Gemma 3 norms each query and key head and rotates its sliding layers with a base of
their own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import GemmaRMSNorm, OutputTransform, declare_attn, declare_ffn, layer_stack, make_stages
from .attention import DecodeLayout, KVCache, RotaryEmbedding, StaticKVCache, StepLayout, TPAttention
from .gemma2_config import GemmaSandwichConfig
from .mlp import TPGatedMLP
from .parts import TwoStageLayer
from .pipeline import enter_stage, leave_stage, place_head, place_stage

__all__ = ["SandwichDecoderLayer", "GemmaSandwichLM"]

#: the norms of a layer, in the order they run
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _on_previous_stage(layer: int) -> OutputTransform:
    """The post-FFN norm of layer `layer`, built on the previous pipeline stage: named in this
    stage's `previous=` declaration; never run here (the sender completes an FFN's output,
    norm included, before the handoff)."""

    def elsewhere(x):
        raise RuntimeError(f"layer {layer}'s post_feedforward_layernorm runs on the previous pipeline stage")

    return OutputTransform(elsewhere, name=f"layer{layer}.post_feedforward_layernorm")


class SandwichDecoderLayer(TwoStageLayer):
    """Attention and MLP, each between a pre-norm (the stage's read) and a post-norm (its
    output transform). `previous_output` is the previous layer's post-FFN transform, which this
    layer's attention stage names as its producer's."""

    def __init__(self, config: GemmaSandwichConfig, layer_id: int, parallel, previous_output: Optional[OutputTransform], *,
                 fusions=None, dtype=None, device=None):
        super().__init__()
        H = config.hidden_size
        self.layer_id = layer_id
        self.rope_kind = config.layer_types[layer_id]
        self.self_attn = TPAttention(
            config, parallel, layer_id,
            scaling=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping,
            sliding_window=config.sliding_window if config.is_sliding(layer_id) else None,
            qk_norm_type=GemmaRMSNorm,
            plugin_kernels=False,
            dtype=dtype, device=device,
        )
        self.mlp = TPGatedMLP(H, config.intermediate_size, parallel.groups["tp"], config.hidden_act, dtype=dtype, device=device)
        for name in NORMS:
            setattr(self, name, GemmaRMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device))
        self.attention_output = OutputTransform(self.post_attention_layernorm, name=f"layer{layer_id}.post_attention_layernorm")
        self.mlp_output = OutputTransform(self.post_feedforward_layernorm, name=f"layer{layer_id}.post_feedforward_layernorm")
        options = {"fusions": fusions} if fusions is not None else {}
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(output_transform=self.attention_output), self.input_layernorm, {**options, "producer": self.self_attn}),
            (declare_ffn(output_transform=self.mlp_output), self.pre_feedforward_layernorm, options),
            previous=declare_ffn(output_transform=previous_output) if layer_id else None,
            terminal=layer_id == config.num_layers - 1,
            label=f"layer{layer_id}",
        )

    def forward(self, hidden_states, forward, step: StepLayout, ropes: dict, cache: Optional[KVCache]):
        return super().forward(hidden_states, forward, step, ropes[self.rope_kind], cache)


class GemmaSandwichLM(nn.Module):
    """Scaled embedding, sandwich layers, final (1 + w) norm, a tied or own head and the final
    logit soft cap; under pipeline parallelism this stage's layers only (the embedding on the
    first stage, the final norm and head on the last)."""

    def __init__(self, config: GemmaSandwichConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        place_stage(self, config, parallel, dtype=dtype, device=device)
        H = config.hidden_size
        layers = []
        first = self.layer_ids[0]
        previous = _on_previous_stage(first - 1) if first else None
        with layer_stack(parallel, reduction=reduction):
            for i in self.layer_ids:
                layers.append(SandwichDecoderLayer(config, i, parallel, previous, fusions=fusions, dtype=dtype, device=device))
                previous = layers[-1].mlp_output
        self.layers = nn.ModuleList(layers)
        place_head(self, lambda: GemmaRMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device), dtype=dtype, device=device)
        kinds = sorted(set(config.layer_types))
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(config.head_dim, config.rope[kind].theta, config.rope[kind].factor).to(device) for kind in kinds}
        )

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def new_static_cache(self, slots: int, max_len: int) -> StaticKVCache:
        """A preallocated cache for CUDA-graph decode (requests live in slots 0..slots-1), with
        the sliding window's mask and a rotary table per layer type."""
        attn = self.layers[0].self_attn
        w = attn.o_proj.weight
        cache = StaticKVCache(
            self.config.num_layers, slots, max_len, attn.kv_heads, attn.head_dim, dtype=w.dtype, device=w.device,
            sliding_window=self.config.sliding_window,
        )
        cache.set_rope_tables({kind: rotary.table(max_len, w.dtype, w.device) for kind, rotary in self.rotary.items()})
        return cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.full((), self.config.embed_scale, dtype=h.dtype, device=h.device)

    def forward(self, input_ids: torch.Tensor, forward, step, cache: Optional[KVCache] = None) -> Optional[torch.Tensor]:
        """Logits [tokens, vocab] for this rank's attention rows; None on an earlier pipeline
        stage (its output went to the next stage)."""
        if forward.extras.get("tbo"):
            raise NotImplementedError(f"{self.config.model_type} runs without two-batch overlap")
        hidden_states = enter_stage(self, input_ids, forward, step)
        if isinstance(cache, StaticKVCache):
            if isinstance(step, DecodeLayout):
                step = cache.bind(step)  # the step's write index and masks, once for every layer
            ropes = {kind: cache.rope(step.positions, kind) for kind in self.rotary}
        else:
            ropes = {kind: rotary(step.positions, hidden_states.dtype) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden_states = layer(hidden_states, forward, step, ropes, cache)
        logits = leave_stage(self, hidden_states, forward, self.norm)
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
