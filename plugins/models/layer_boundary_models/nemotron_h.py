"""Nemotron-H: a heterogeneous stack in which every layer is one stage with its own norm.

The layer pattern (`hybrid_override_pattern`: M = Mamba-2, * = attention, - = MLP, E = MoE)
decides each layer's kind. Mamba and attention layers are single-stage mixers declared
`declare_attn(reduction=SCOPED, gathers_tp_input=False)`; MLP and MoE layers are FFNs. Every
layer names its real neighbours (`previous=` the layer before, `following=` the layer after),
so the boundaries decide per batch whether a mixer leaves its attention-TP sum to the next
stage: always before an FFN, before another mixer only without attention DP.

A pipeline split gives each stage a contiguous run of layers; the first stage embeds, the last
applies the final norm and the head, and the handoff travels over the pipeline group
(`to_pp()` on the sender, `from_pp()` on the receiver's first layer).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from layer_boundary import (
    MoeFinalizeHandoff,
    ProducerReduction,
    RMSNorm,
    SumGroup,
    declare_attn,
    declare_ffn,
    get_forward,
    layer_stack,
    make_stages,
    reduce_output,
    residual_batch,
    shard_cols,
    shard_rows,
)
from .attention import KVCache, StepLayout, TPAttention
from .config import ConfigError, FamilyConfig
from .mamba import MambaStates, TPMamba2Mixer
from .mlp import TPPlainMLP, activation, dense_experts
from .parts import place_experts
from .pipeline import PipelineHandoff, pipeline_layers

__all__ = ["NemotronHConfig", "NemotronHRMSNorm", "NemotronHForCausalLM", "NemotronHCache", "stage_declaration", "pipeline_layers"]

#: pattern characters and Hugging Face's layer-type names
LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MIXERS = frozenset("M*")
_ALIASES = {  # older Nemotron-H config keys that Hugging Face still accepts
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
}
_DEFAULTS = {  # Hugging Face's NemotronHConfig defaults for optional keys
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "time_step_min": 0.001,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
}


def _pattern(f) -> str:
    names = {v: k for k, v in LAYER_TYPES.items()}
    key = f.first(("layers_block_type", "layer_types"))
    types = f.list(key, (), of=str) if key else ()
    if types:
        unknown = sorted(set(types) - set(names))
        if unknown:
            raise ConfigError(f"layers_block_type has unknown layer types {unknown}; use {sorted(names)}")
        return "".join(names[t] for t in types)
    pattern = f.str("hybrid_override_pattern", None)
    if pattern is None:
        return "ME*-"  # Hugging Face's default stack: linear_attention, moe, full_attention, mlp
    if not pattern:
        raise ConfigError("hybrid_override_pattern is empty; give one character per layer (M, *, - or E)")
    unknown = sorted(set(pattern) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"hybrid_override_pattern has unknown characters {unknown}; use M, *, - and E")
    return pattern


@attrs.frozen(kw_only=True)
class NemotronHConfig:
    model_type: str
    architecture: str
    pattern: str
    vocab_size: int
    hidden_size: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    # attention ("*")
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # MLP ("-") and experts
    intermediate_size: int
    mlp_hidden_act: str
    # Mamba-2 ("M")
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    time_step_min: float
    # MoE ("E")
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    moe_latent_size: Optional[int]
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hf: Mapping[str, Any] = attrs.field(factory=dict, repr=False)

    # what the shared reference-model code reads
    qk_norm = False

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "NemotronHConfig":
        cfg = dict(FamilyConfig.fields(raw, "nemotron_h").raw)
        for old, new in _ALIASES.items():
            if old in cfg:
                cfg[new] = cfg.pop(old)
        f = FamilyConfig.fields(cfg, "nemotron_h")
        for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
            if f.bool(key, False):
                raise ConfigError(f"{key}=true is not supported by the nemotron_h reference model")
        if f.get("sliding_window"):
            raise ConfigError("sliding-window attention is not supported by the nemotron_h reference model")

        def size(key, minimum=1):  # Hugging Face's default when the config leaves it out
            return f.int(key, _DEFAULTS.get(key), min=minimum)

        hidden = f.int("hidden_size", min=1)
        heads = size("num_attention_heads")
        act = f.str("mlp_hidden_act", _DEFAULTS["mlp_hidden_act"])
        try:
            activation(act)
        except ValueError:
            raise ConfigError(f"mlp_hidden_act={act!r} is not supported by the nemotron_h reference model") from None
        if f.str("mamba_hidden_act", _DEFAULTS["mamba_hidden_act"]) != "silu":
            raise ConfigError("mamba_hidden_act must be 'silu' (the Mamba-2 convolution's activation)")
        experts_key = f.first(("n_routed_experts", "num_local_experts")) or "n_routed_experts"
        return cls(
            model_type="nemotron_h",
            architecture=(f.list("architectures", (), of=str) or ("NemotronHForCausalLM",))[0],
            pattern=_pattern(f),
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            layer_norm_epsilon=f.float("layer_norm_epsilon", _DEFAULTS["layer_norm_epsilon"], positive=True),
            tie_word_embeddings=f.bool("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"]),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads"),
            head_dim=f.int("head_dim", None, min=1) or hidden // heads,
            intermediate_size=size("intermediate_size"),
            mlp_hidden_act=act,
            mamba_num_heads=size("mamba_num_heads"),
            mamba_head_dim=size("mamba_head_dim"),
            n_groups=size("n_groups"),
            ssm_state_size=size("ssm_state_size"),
            conv_kernel=size("conv_kernel"),
            chunk_size=size("chunk_size"),
            use_conv_bias=f.bool("use_conv_bias", _DEFAULTS["use_conv_bias"]),
            time_step_min=f.float("time_step_min", _DEFAULTS["time_step_min"], positive=True),
            n_routed_experts=f.int(experts_key, _DEFAULTS["n_routed_experts"], min=1),
            top_k=size("num_experts_per_tok"),
            moe_intermediate_size=size("moe_intermediate_size"),
            shared_intermediate_size=size("moe_shared_expert_intermediate_size"),
            moe_latent_size=f.int("moe_latent_size", None, min=0) or None,
            n_group=size("n_group"),
            topk_group=size("topk_group"),
            norm_topk_prob=f.bool("norm_topk_prob", _DEFAULTS["norm_topk_prob"]),
            routed_scaling_factor=f.float("routed_scaling_factor", _DEFAULTS["routed_scaling_factor"]),
            hf=raw,
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        attn_tp, tp = topology.attn_tp, topology.tp
        if topology.attn_cp > 1:
            raise ConfigError("nemotron_h: context parallel is not supported for Mamba mixers; use --attn-cp 1")
        if topology.pp > self.num_layers:
            raise ConfigError(f"--pp {topology.pp} is more than the {self.num_layers} layers of this model")
        if "*" in self.pattern:
            if self.num_heads % attn_tp:
                raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by attention TP {attn_tp}")
            kv = self.num_kv_heads
            if kv % attn_tp and attn_tp % kv:
                raise ConfigError(f"num_key_value_heads={kv} and attention TP {attn_tp} must divide one another (split or replicate KV heads)")
        if "M" in self.pattern:
            if self.mamba_num_heads % self.n_groups:
                raise ConfigError(f"mamba_num_heads={self.mamba_num_heads} is not divisible by n_groups={self.n_groups}")
            if self.n_groups % attn_tp:
                raise ConfigError(
                    f"n_groups={self.n_groups} is not divisible by attention TP {attn_tp}: each rank keeps whole B/C and "
                    "gated-norm groups; choose --tp/--attn-dp so that attention TP divides n_groups"
                )
        if "-" in self.pattern and self.intermediate_size % tp:
            raise ConfigError(f"intermediate_size={self.intermediate_size} is not divisible by TP {tp}")
        if "E" in self.pattern:
            if self.n_routed_experts % topology.moe_ep:
                raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by moe_ep={topology.moe_ep}")
            if self.moe_intermediate_size % topology.moe_tp:
                raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by moe_tp={topology.moe_tp}")
            if self.shared_intermediate_size % tp:
                raise ConfigError(f"moe_shared_expert_intermediate_size={self.shared_intermediate_size} is not divisible by TP {tp}")
            if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
                raise ConfigError(f"n_routed_experts={self.n_routed_experts} must split into n_group={self.n_group} groups of at least 2")


# ---------------------------------------------------------------------------------------------
# stage declarations: one per layer, shared by the layer and its neighbours
# ---------------------------------------------------------------------------------------------


def _next_ffn_is_sparse(pattern: str, layer: int) -> bool:
    later = [c for c in pattern[layer + 1 :] if c not in MIXERS]
    return bool(later) and later[0] == "E"


def stage_declaration(pattern: str, layer: int):
    """The declaration of layer `layer`; its neighbours build `previous=`/`following=` from the
    same function, so both sides of every edge describe it the same way."""
    kind = pattern[layer]
    if kind in MIXERS:
        return declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    return declare_ffn(sparse=kind == "E", next_sparse=_next_ffn_is_sparse(pattern, layer))


# ---------------------------------------------------------------------------------------------
# compute
# ---------------------------------------------------------------------------------------------


class NemotronHRMSNorm(RMSNorm):
    """Nemotron-H's RMSNorm: the weight multiplies in float32 before rounding to the input dtype."""

    #: the fused add + norm kernels scale the same way (fp32 weight multiply, one rounding)
    scale_as_kernels = True

    def _scale(self, normalized: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(normalized.dtype) * normalized).to(out_dtype)


class NemotronHRouter(nn.Module):
    """Sigmoid scores, grouped top-k with a score-correction bias, normalised and scaled weights
    (float32, as Hugging Face computes them). Replicated on every rank."""

    def __init__(self, config: NemotronHConfig, *, dtype=None, device=None):
        super().__init__()
        E = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size, dtype=dtype, device=device))
        self.score_bias = nn.Parameter(torch.empty(E, dtype=dtype, device=device))
        self.top_k = config.top_k
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scale = config.routed_scaling_factor

    def choose(self, scores: torch.Tensor):
        """(the scores the choice ranks, each row's top_k experts): the biased scores of the
        best `topk_group` groups (the others -inf) and their top_k; `forward` weighs whichever
        experts this returns, so a routing check can record and pin it."""
        E = scores.shape[-1]
        choice = scores + self.score_bias
        best_two = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(best_two, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(best_two).scatter_(1, groups, 1)
        keep = keep.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        return choice, torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, x: torch.Tensor, segments: Sequence[tuple[int, int]] = ()):
        """(weights [T, k] float32, expert ids [T, k]).

        `segments` are the (first row, rows) of each request. Hugging Face routes a request at a
        time, and its float32 logits and sigmoid round differently with the row count (a single
        row is a matrix-vector product; vectorised loops end in a scalar tail), so each request's
        rows are scored alone, which reproduces those bits; rows outside every segment (padding)
        are scored per gap, the tail together."""
        E = self.weight.shape[0]
        x32, w32 = x.type(torch.float32), self.weight.type(torch.float32)
        if not segments:
            scores = F.linear(x32, w32).sigmoid()
        else:
            scores = x32.new_empty(x.shape[0], E)
            covered = 0  # segments come in row order; the gaps between them and the tail are padding
            for start, count in segments:
                if start > covered:
                    scores[covered:start] = F.linear(x32[covered:start], w32).sigmoid()
                scores[start : start + count] = F.linear(x32[start : start + count], w32).sigmoid()
                covered = max(covered, start + count)
            # the padding after the last request, scored together (computed from the segments, a
            # host fact, so the shape never depends on tensor data)
            scores[covered:] = F.linear(x32[covered:], w32).sigmoid()
        _, idx = self.choose(scores)
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, idx


class TPNemotronHMoE(nn.Module):
    """Routed non-gated experts over EP x TP plus a TP-sharded shared expert; the partial sum over
    the TP group honours the exit's flags, and a deferred finalize is handed off when asked
    (without a latent projection, whose second half must follow the weighted combine)."""

    def __init__(self, config: NemotronHConfig, parallel, *, dtype=None, device=None):
        super().__init__()
        topo = parallel.topology
        H = config.hidden_size
        self.group = parallel.groups["tp"]
        self.router = NemotronHRouter(config, dtype=dtype, device=device)
        per_rank = place_experts(self, parallel, config.n_routed_experts)
        width = config.moe_intermediate_size // topo.moe_tp
        inner = config.moe_latent_size or H
        self.up = nn.Parameter(torch.empty(per_rank, width, inner, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(per_rank, inner, width, dtype=dtype, device=device))
        self.act = activation(config.mlp_hidden_act)
        self.top_k = config.top_k
        self.latent_in = self.latent_out = None
        if config.moe_latent_size:
            self.latent_in = nn.Linear(H, config.moe_latent_size, bias=False, dtype=dtype, device=device)
            self.latent_out = nn.Linear(config.moe_latent_size, H, bias=False, dtype=dtype, device=device)
        self.shared = TPPlainMLP(H, config.shared_intermediate_size, self.group, config.mlp_hidden_act, reduce_results=False, dtype=dtype, device=device)

    @torch.no_grad()
    def load_full(self, *, router, score_bias, up, down, shared_up, shared_down, latent_in=None, latent_out=None) -> None:
        """up [E, I, inner], down [E, inner, I] (Hugging Face's stacked experts)."""
        self.router.weight.copy_(router)
        self.router.score_bias.copy_(score_bias)
        for j, e in enumerate(range(self.first, self.first + self.owned)):
            self.up[j].copy_(shard_rows(up[e], self.moe_tp_rank, self.moe_tp))
            self.down[j].copy_(shard_cols(down[e], self.moe_tp_rank, self.moe_tp))
        self.shared.load_full(shared_up, shared_down)
        if self.latent_in is not None:
            self.latent_in.weight.copy_(latent_in)
            self.latent_out.weight.copy_(latent_out)

    def forward(self, x: torch.Tensor, segments: Sequence[tuple[int, int]] = ()):
        """x: the full rows of the batch; `segments`: each request's rows (see the router)."""
        weights, idx = self.router(x, segments)
        inner = x if self.latent_in is None else self.latent_in(x)
        rows = inner.new_zeros(x.shape[0], self.top_k, inner.shape[-1])
        dense = dense_experts(x)
        for j in range(self.owned):
            if dense:  # expert j on every row, kept where the router chose it
                y = F.linear(self.act(F.linear(inner, self.up[j])), self.down[j])
                rows = rows + (idx == self.first + j).unsqueeze(-1).to(rows.dtype) * y.unsqueeze(1)
                continue
            tok, k = torch.where(idx == self.first + j)
            if tok.numel():
                rows[tok, k] = F.linear(self.act(F.linear(inner[tok], self.up[j])), self.down[j])
        shared = self.shared(x)
        if self.latent_out is None and get_forward().defer_moe_finalize:
            return MoeFinalizeHandoff(rows, weights, idx, shared, self.group, SumGroup.MOE_OUTPUT)
        routed = (rows * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.latent_out is not None:
            routed = self.latent_out(routed)  # linear: the partial sums pass through unchanged
        return reduce_output(routed + shared, self.group)


class NemotronHCache:
    """Keys/values of attention layers and Mamba states of mixer layers, per request."""

    def __init__(self, num_layers: int):
        self.kv = KVCache(num_layers)
        self.mamba = MambaStates()

    def clear(self) -> None:
        self.kv.clear()
        self.mamba.clear()


class NemotronHLayer(nn.Module):
    """One layer = one stage: norm, then a mixer or an FFN, then the residual add (the boundary's)."""

    def __init__(self, config: NemotronHConfig, layer_id: int, parallel, *, fusions=None, dtype=None, device=None):
        super().__init__()
        pattern = config.pattern
        self.layer_id = layer_id
        self.kind = pattern[layer_id]
        H = config.hidden_size
        self.norm = NemotronHRMSNorm(H, config.layer_norm_epsilon, dtype=dtype, device=device)
        if self.kind == "M":
            self.mixer = TPMamba2Mixer(config, layer_id, parallel.groups["attn_tp"], dtype=dtype, device=device)
        elif self.kind == "*":
            self.mixer = TPAttention(config, parallel, layer_id, reduce_results=True, dtype=dtype, device=device)
        elif self.kind == "-":
            self.mixer = TPPlainMLP(H, config.intermediate_size, parallel.groups["tp"], config.mlp_hidden_act, dtype=dtype, device=device)
        else:
            self.mixer = TPNemotronHMoE(config, parallel, dtype=dtype, device=device)
        last = config.num_layers - 1
        options = {"fusions": fusions} if fusions is not None else {}
        (self.boundary,) = make_stages(
            (stage_declaration(pattern, layer_id), self.norm, options),
            previous=stage_declaration(pattern, layer_id - 1) if layer_id else None,
            following=stage_declaration(pattern, layer_id + 1) if layer_id < last else None,
            terminal=layer_id == last,
            label=f"layer{layer_id}:{self.kind}",
        )

    def forward(self, hidden_states, forward, step: StepLayout, cache: Optional[NemotronHCache]):
        x = self.boundary.prepare(hidden_states, forward)
        with self.boundary.exit(forward) as output:
            if self.kind == "M":
                y = self.mixer(x, step, cache.mamba if cache is not None else None) if x.shape[0] else x.new_empty(x.shape)
            elif self.kind == "*":
                y = self.mixer(x, step, None, cache.kv if cache is not None else None) if x.shape[0] else x.new_empty(x.shape)
            elif self.kind == "E":
                y = self.mixer(x, request_segments(forward, step))
            else:
                y = self.mixer(x)
        return output.finish(y)


def request_segments(forward, step: StepLayout) -> list[tuple[int, int]]:
    """(first row, rows) of every request in the FFN's input rows: this rank's requests, or under
    attention DP the requests of every DP rank when the step carries them (`dp_request_counts`),
    each DP rank's rows starting at its offset in the gathered rows."""
    topo = forward.parallel.topology
    if topo.attn_dp == 1:
        return list(zip(step.starts, step.counts))
    per_rank = step.dp_request_counts
    if per_rank is None:
        offset = forward.dp_offset
        return [(offset + start, count) for start, count in zip(step.starts, step.counts)]
    out = []
    for d, counts in enumerate(per_rank):
        offset = forward.slot_rows * d if forward.slot_rows is not None else sum(forward.dp_counts[:d])
        for count in counts:
            out.append((offset, count))
            offset += count
    return out


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


class NemotronHForCausalLM(nn.Module):
    """Embedding, this pipeline stage's layers, final norm and head (on the last stage only)."""

    def __init__(self, config: NemotronHConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        self.config = config
        self.parallel = parallel
        config.check_topology(parallel.topology)
        pp, stage = parallel.topology.pp, parallel.pp_rank
        self.layer_ids = pipeline_layers(config.num_layers, pp, stage)
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        H = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, H, dtype=dtype, device=device) if self.is_first else None
        with layer_stack(parallel, reduction=reduction):
            self.layers = nn.ModuleList(
                NemotronHLayer(config, i, parallel, fusions=fusions, dtype=dtype, device=device) for i in self.layer_ids
            )
        self.norm_f = self.lm_head = None
        if self.is_last:
            self.norm_f = NemotronHRMSNorm(H, config.layer_norm_epsilon, dtype=dtype, device=device)
            self.lm_head = nn.Linear(H, config.vocab_size, bias=False, dtype=dtype, device=device)
            if config.tie_word_embeddings and self.embeddings is not None:
                self.lm_head.weight = self.embeddings.weight
        self.dtype = dtype or torch.get_default_dtype()
        self.handoff = PipelineHandoff(parallel, H, self.dtype)

    def routed_layers(self) -> list:
        """(layer id, router) of every MoE layer this rank holds, for a routing check: each
        router's `choose(scores) -> (choice scores, experts)` picks its layer's experts."""
        return [(layer.layer_id, layer.mixer.router) for layer in self.layers if layer.kind == "E"]

    def new_cache(self) -> NemotronHCache:
        return NemotronHCache(self.config.num_layers)

    def forward(self, input_ids: torch.Tensor, forward, step: StepLayout, cache: Optional[NemotronHCache] = None):
        """Logits [tokens, vocab] of this rank's attention rows on the last pipeline stage; None
        on an earlier stage (its output went to the next stage)."""
        if self.is_first:
            residual_batch.start(forward)
            hidden_states = self.embeddings(input_ids)
        else:
            tensors = self.handoff.receive(step.num_tokens, input_ids.device)
            hidden_states = self.layers[0].boundary.from_pp(tensors, forward)
        for layer in self.layers:
            hidden_states = layer(hidden_states, forward, step, cache)
        if not self.is_last:
            self.handoff.send(residual_batch.to_pp(hidden_states, forward))
            return None
        hidden_states = residual_batch.norm(hidden_states, forward, self.norm_f, skip_empty=True)
        return self.lm_head(hidden_states)
