"""OLMo-2, GPT-NeoX and Cohere written against the public API: three residual shapes on the
boundaries the pre-norm decoders use, each layer two stages (attention, then the MLP).

- post-norm (OLMo-2): `h = h + post_norm(attn(h))`, `h = h + post_norm(mlp(h))`. Each stage
  reads the residual unnormed and declares its post-norm as the `output_transform`, which runs
  on the sublayer's complete output (after its sum), before the add.
- parallel (GPT-NeoX's `use_parallel_residual`, Cohere): `h = h + attn(n1(h)) + mlp(n2(h))`.
  The MLP stage is declared `declare_ffn(parallel_residual=True)`: it reads its norm of the
  residual the attention read (Cohere: n2 is n1, the one input LayerNorm), and the attention's
  partial output joins the MLP's, so one sum completes both (one all-reduce a layer where
  attention TP is TP).
- sequential (GPT-NeoX otherwise): pre-norm, `h = h + attn(n1(h))`, `h = h + mlp(n2(h))`.

The post-norm and sequential shapes complete each stage's own sum (two a layer).

`new_static_cache(slots, max_len)` gives the preallocated cache of CUDA-graph decode (`bench
decode`): its prefill writes the cache, a decode step binds it once for every layer and looks its
rotary factors up in a table of what the per-request path computes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import LayerNorm, OutputTransform, declare_attn, declare_ffn, layer_stack, make_stages
from .attention import DecodeLayout, KVCache, StaticKVCache, StepLayout
from .config import ConfigError
from .mlp import TPGatedMLP, TPPlainMLP
from .overlapped import run_layers
from .parts import TwoStageLayer
from .pipeline import enter_stage, leave_stage, place_head, place_stage
from .residual_attention import Rotary, ShardedAttention
from .residual_config import PARALLEL, POST_NORM, ResidualConfig
from .residual_norms import Olmo2RMSNorm
from .residual_reads import Unnormed

__all__ = ["ResidualLayer", "ResidualCausalLM", "make_norm", "pipeline_edge"]


def make_norm(config: ResidualConfig, *, dtype=None, device=None) -> nn.Module:
    """The family's hidden-size norm: OLMo-2's RMSNorm, GPT-NeoX's LayerNorm with bias
    (statistics as wide as the input, as torch.nn.LayerNorm), Cohere's LayerNorm without bias
    (statistics in fp32)."""
    H, eps = config.hidden_size, config.norm_eps
    if config.model_type == "olmo2":
        return Olmo2RMSNorm(H, eps, dtype=dtype, device=device)
    if config.model_type == "gpt_neox":
        return LayerNorm(H, eps, bias=True, compute_dtype=None, dtype=dtype, device=device)
    return LayerNorm(H, eps, bias=False, dtype=dtype, device=device)


def pipeline_edge(config: ResidualConfig):
    """`previous=` of a pipeline stage's first layer: the MLP stage before it, which the previous
    pipeline stage built, described from this side of the cut (the same facts)."""
    if config.residual == POST_NORM:
        return declare_ffn(output_transform=POST_NORM_ON_THE_PREVIOUS_STAGE)
    return declare_ffn(parallel_residual=config.residual == PARALLEL)


def _on_the_previous_stage(x):
    raise RuntimeError("the post_feedforward_layernorm before a pipeline cut runs on the sending stage, which completes its sum")


#: the output transform of the MLP stage before a pipeline cut, as the receiving stage describes
#: it: the sender completes that sum and applies the norm before the handoff
POST_NORM_ON_THE_PREVIOUS_STAGE = OutputTransform(_on_the_previous_stage, name="post_feedforward_layernorm (previous stage)")


class ResidualLayer(TwoStageLayer):
    """One layer, two stages; `previous` is the declaration of the MLP stage before it (None for
    the first layer of the model)."""

    def __init__(self, config: ResidualConfig, layer_id: int, parallel, rotary: Rotary, previous=None, *, fusions=None, dtype=None,
                 device=None):
        super().__init__()
        H = config.hidden_size
        self.layer_id = layer_id
        self.self_attn = ShardedAttention(config, parallel, layer_id, rotary, dtype=dtype, device=device)
        tp = parallel.groups["tp"]
        if config.gated_mlp:
            self.mlp = TPGatedMLP(H, config.intermediate_size, tp, config.hidden_act, dtype=dtype, device=device)
        else:
            self.mlp = TPPlainMLP(H, config.intermediate_size, tp, config.hidden_act, bias=config.mlp_bias, dtype=dtype, device=device)
        options = {"fusions": fusions} if fusions is not None else {}
        if config.residual == POST_NORM:
            self.post_attention_layernorm = make_norm(config, dtype=dtype, device=device)
            self.post_feedforward_layernorm = make_norm(config, dtype=dtype, device=device)
            attn = declare_attn(output_transform=OutputTransform(self.post_attention_layernorm, name="post_attention_layernorm"))
            ffn = declare_ffn(output_transform=OutputTransform(self.post_feedforward_layernorm, name="post_feedforward_layernorm"))
            attn_norm = ffn_norm = Unnormed(H)
        else:
            self.input_layernorm = make_norm(config, dtype=dtype, device=device)
            attn, attn_norm = declare_attn(), self.input_layernorm
            if config.model_type == "cohere":  # one norm feeds both branches
                ffn_norm = self.input_layernorm
            else:
                self.post_attention_layernorm = make_norm(config, dtype=dtype, device=device)
                ffn_norm = self.post_attention_layernorm
            ffn = declare_ffn(parallel_residual=config.residual == PARALLEL)
        self.attn_boundary, self.ffn_boundary = make_stages(
            (attn, attn_norm, {**options, "producer": self.self_attn}),
            (ffn, ffn_norm, options),
            previous=previous,
            terminal=layer_id == config.num_layers - 1,
            label=f"layer{layer_id}",
        )


class ResidualCausalLM(nn.Module):
    """Embedding, layers, final norm and a replicated LM head (times Cohere's logit scale); under
    pipeline parallelism this stage's layers, the embedding on the first stage and the final
    norm and head on the last (a tied head keeps its own copy there)."""

    def __init__(self, config: ResidualConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, ResidualConfig):
            raise ConfigError(f"ResidualCausalLM builds olmo2, gpt_neox and cohere configs, got {type(config).__name__}")
        place_stage(self, config, parallel, dtype=dtype, device=device)
        self.rotary = Rotary(config).to(device) if device is not None else Rotary(config)
        self.layers = nn.ModuleList()
        previous = pipeline_edge(config) if self.layer_ids[0] else None
        with layer_stack(parallel, reduction=reduction):
            for i in self.layer_ids:
                layer = ResidualLayer(config, i, parallel, self.rotary, previous, fusions=fusions, dtype=dtype, device=device)
                self.layers.append(layer)
                previous = layer.ffn_boundary.declaration
        place_head(self, lambda: make_norm(config, dtype=dtype, device=device), dtype=dtype, device=device)

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def new_static_cache(self, slots: int, max_len: int) -> StaticKVCache:
        """A preallocated cache for CUDA-graph decode (requests live in slots 0..slots-1), with
        the rotary factors of positions 0..max_len-1 as the dynamic path computes them (partial
        and interleaved rotaries included: the attention turns its channels with them alike)."""
        attn = self.layers[0].self_attn
        w = attn.o_proj.weight
        cache = StaticKVCache(self.config.num_layers, slots, max_len, attn.kv_heads, attn.head_dim, dtype=w.dtype, device=w.device)
        cache.rope_table = self.rotary.table(max_len, w.dtype, w.device)
        return cache

    def plan_notes(self) -> dict:
        """Model-wide lines for `layer-boundary plan`: the collectives compute issues itself."""
        attn = self.layers[0].self_attn if len(self.layers) else None
        if attn is None or attn.qk_norm is None:
            return {}
        what = attn.qk_norm.collective or "nothing (one attention-TP rank)"
        return {"qk_norm": f"q/k norms over the whole projections (statistics across attention TP): {what} per layer"}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, forward, step: StepLayout, cache: Optional[KVCache] = None) -> Optional[torch.Tensor]:
        """Logits [tokens, vocab] for this rank's attention rows; None on an earlier pipeline stage."""
        hidden_states = enter_stage(self, input_ids, forward, step)
        if isinstance(cache, StaticKVCache):
            if forward.extras.get("tbo"):
                raise NotImplementedError(f"{self.config.model_type} runs two-batch overlap with its per-request cache (new_cache), not a static one")
            if isinstance(step, DecodeLayout):
                step = cache.bind(step)  # the step's write index and mask, once for every layer
            rope = cache.rope(step.positions)
        else:
            rope = self.rotary(step.positions, hidden_states.dtype)
        hidden_states = run_layers(self.layers, hidden_states, forward, step, rope, cache)
        logits = leave_stage(self, hidden_states, forward, self.norm)
        if logits is not None and self.config.logit_scale is not None:
            logits = logits * self.config.logit_scale
        return logits
