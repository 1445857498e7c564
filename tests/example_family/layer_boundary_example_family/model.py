"""Llama on layer-boundary, written the way an engine's model author would: each layer declares
its two stages once and keeps its compute; the boundaries complete every sum, move rows between
the attention-DP and TP layouts, add the residual and run the norms.

Numerics follow Hugging Face's eager Llama (rotary factors in float32 then cast, softmax in
float32), so a float64 run matches it to rounding.
"""

from __future__ import annotations

import copy
from typing import Optional

import attrs
import torch
from torch import nn

from layer_boundary import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import (
    BuildRequest,
    ConfigError,
    ConfigFields,
    DecodeLayout,
    StepLayout,
    TensorSource,
    loads_weights,
    mark_unloaded,
)

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "attention_bias": True,
    "mlp_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "max_position_embeddings": 256,
}


def tiny_config() -> dict:
    return copy.deepcopy(TINY)


def realistic_config() -> dict:
    """A Llama 3 8B layer's widths (`layer-boundary bench decode --model llama`)."""
    return dict(TINY, vocab_size=32000, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, attention_bias=False, num_hidden_layers=8)


@attrs.frozen(kw_only=True)
class LlamaConfig:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    hf: dict = attrs.field(repr=False)

    @classmethod
    def from_hf(cls, raw: dict) -> "LlamaConfig":
        f = ConfigFields(raw, "llama")  # every field checked: a wrong one is one line naming it and its type
        rope = f.sub("rope_parameters")
        if rope.str("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.rope_type={rope.get('rope_type')!r}: this family implements the default rotary only")
        if f.str("hidden_act", "silu") != "silu" or f.bool("mlp_bias", False):
            raise ConfigError("hidden_act must be silu and mlp_bias false: this family implements Llama's SiLU MLP without biases")
        hidden, heads = f.int("hidden_size", min=1), f.int("num_attention_heads", min=1)
        return cls(
            model_type=f.str("model_type"),
            architecture=(f.list("architectures", (), of=str) or ("LlamaForCausalLM",))[0],
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            num_layers=f.int("num_hidden_layers", min=1),
            heads=heads,
            kv_heads=f.int("num_key_value_heads", heads, min=1),
            head_dim=f.int("head_dim", hidden // heads, min=1),
            intermediate_size=f.int("intermediate_size", min=1),
            eps=f.float("rms_norm_eps", 1e-6, positive=True),
            rope_theta=rope.float("rope_theta", None, positive=True) or f.float("rope_theta", 10000.0, positive=True),
            attention_bias=f.bool("attention_bias", False),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            hf=dict(raw),
        )

    def check_topology(self, topology) -> None:
        if topology.pp > 1 or topology.attn_cp > 1:
            raise ConfigError("the llama example family runs without pipeline stages or context parallel; use --pp 1 --attn-cp 1")
        if self.heads % topology.attn_tp or self.kv_heads % topology.attn_tp:
            raise ConfigError(f"attention TP {topology.attn_tp} must divide num_attention_heads={self.heads} and num_key_value_heads={self.kv_heads}")
        if self.intermediate_size % topology.tp:
            raise ConfigError(f"intermediate_size={self.intermediate_size} is not divisible by TP {topology.tp}")


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [tokens, head_dim]: angles in float32, then cast, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


class GrowingCache:
    """Per layer and request: the keys and values so far [kv_heads, tokens, D]."""

    def __init__(self, layers: int):
        self.entries = [dict() for _ in range(layers)]


class StaticCache:
    """Preallocated keys and values [layers, slots, kv_heads, max_len, D] for CUDA-graph decode."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        self.k = torch.zeros(layers, slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len

    def snapshot(self):
        return self.k.clone(), self.v.clone()

    def restore(self, saved) -> None:
        self.k.copy_(saved[0])
        self.v.copy_(saved[1])


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, parallel, layer: int, dtype=None, device=None):
        super().__init__()
        group = parallel.groups["attn_tp"]
        self.layer, self.group = layer, group
        self.heads, self.kv_heads = config.heads // group.size, config.kv_heads // group.size
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        H, D = config.hidden_size, config.head_dim
        self.q_proj = ColumnParallelLinear(H, config.heads * D, group, bias=config.attention_bias, dtype=dtype, device=device)
        self.k_proj = ColumnParallelLinear(H, config.kv_heads * D, group, bias=config.attention_bias, dtype=dtype, device=device)
        self.v_proj = ColumnParallelLinear(H, config.kv_heads * D, group, bias=config.attention_bias, dtype=dtype, device=device)
        # the boundary completes the output projection's sum (a PARTIAL producer)
        # (its bias is added on one rank, so the sum holds it once)
        self.o_proj = RowParallelLinear(config.heads * D, H, group, bias=config.attention_bias, reduce_results=False, dtype=dtype, device=device)

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [heads, t, D] against keys/values [kv_heads, n, D]; Hugging Face's eager order."""
        groups = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.head_dim**-0.5 + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    def forward(self, x: torch.Tensor, step, cache) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.heads, D)
        k = self.k_proj(x).view(T, self.kv_heads, D)
        v = self.v_proj(x).view(T, self.kv_heads, D)
        cos, sin = rotary(step.positions, D, self.theta, x.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if isinstance(step, DecodeLayout):
            out = self._decode_static(q, k, v, step, cache)
        else:
            out = torch.cat([self._request(q, k, v, step, i, cache) for i in range(len(step.rids))]) if T else q.new_zeros(0, self.heads, D)
        return self.o_proj(out.reshape(T, self.heads * D))

    def _request(self, q, k, v, step: StepLayout, i: int, cache) -> torch.Tensor:
        rows = slice(step.starts[i], step.starts[i] + step.counts[i])
        keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        past = step.past[i]
        if isinstance(cache, StaticCache):  # a static prefill: request i in slot i
            cache.k[self.layer, i, :, past : past + keys.shape[1]] = keys
            cache.v[self.layer, i, :, past : past + keys.shape[1]] = values
            keys, values = cache.k[self.layer, i, :, : past + keys.shape[1]], cache.v[self.layer, i, :, : past + keys.shape[1]]
        elif cache is not None:
            held = cache.entries[self.layer].get(step.rids[i])
            if held is not None:
                keys, values = torch.cat((held[0], keys), dim=1), torch.cat((held[1], values), dim=1)
            cache.entries[self.layer][step.rids[i]] = (keys, values)
        t, n = step.counts[i], keys.shape[1]
        allowed = torch.arange(n, device=q.device)[None, :] <= torch.arange(past, past + t, device=q.device)[:, None]
        mask = torch.zeros(t, n, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
        return self._attend(q[rows].transpose(0, 1), keys, values, mask).transpose(0, 1)

    def _decode_static(self, q, k, v, step: DecodeLayout, cache: StaticCache) -> torch.Tensor:
        """One token per row: written at its position in its slot, attending to 0..position."""
        slots = step.slots if step.slots is not None else torch.arange(q.shape[0], device=q.device)
        cache.k[self.layer, slots, :, step.positions] = k
        cache.v[self.layer, slots, :, step.positions] = v
        keys, values = cache.k[self.layer, slots], cache.v[self.layer, slots]  # [rows, kv_heads, max_len, D]
        allowed = torch.arange(cache.max_len, device=q.device)[None, :] <= step.positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
        out = torch.stack([self._attend(q[r, :, None], keys[r], values[r], mask[r][None]) for r in range(q.shape[0])]) if q.shape[0] else q[:, :, None]
        return out[:, :, 0]


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, parallel, dtype=None, device=None):
        super().__init__()
        group, H, I = parallel.groups["tp"], config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(H, I, group, dtype=dtype, device=device)
        self.up_proj = ColumnParallelLinear(H, I, group, dtype=dtype, device=device)
        # its sum is all-reduced here unless the open exit scope leaves it to the boundary
        self.down_proj = RowParallelLinear(I, H, group, dtype=dtype, device=device)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: LlamaConfig, parallel, layer: int, fusions=None, dtype=None, device=None):
        super().__init__()
        H = config.hidden_size
        self.self_attn = Attention(config, parallel, layer, dtype, device)
        self.mlp = MLP(config, parallel, dtype, device)
        self.input_layernorm = RMSNorm(H, config.eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(H, config.eps, dtype=dtype, device=device)
        options = {} if fusions is None else {"fusions": fusions}
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(), self.input_layernorm, {**options, "producer": self.self_attn}),
            (declare_ffn(), self.post_attention_layernorm, options),
            previous=declare_ffn() if layer else None,
            terminal=layer == config.num_layers - 1,
            label=f"layer{layer}",
        )

    def forward(self, h, forward, step, cache):
        h = self.attn_boundary.prepare(h, forward)
        h = self.attn_boundary.finish(self.self_attn(h, step, cache), forward)
        h = self.ffn_boundary.prepare(h, forward)
        with self.ffn_boundary.exit(forward) as out:
            y = self.mlp(h)
        return out.finish(y)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        config.check_topology(parallel.topology)
        self.config, self.parallel = config, parallel
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H, dtype=dtype, device=device)
        with layer_stack(parallel, reduction=reduction):
            self.layers = nn.ModuleList(Layer(config, parallel, i, fusions, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(H, config.eps, dtype=dtype, device=device)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self) -> GrowingCache:
        return GrowingCache(self.config.num_layers)

    def new_static_cache(self, slots: int, max_len: int) -> StaticCache:
        w = self.lm_head.weight
        attn = self.layers[0].self_attn
        return StaticCache(self.config.num_layers, slots, max_len, attn.kv_heads, attn.head_dim, w.dtype, w.device)

    def forward(self, input_ids, forward, step, cache=None) -> Optional[torch.Tensor]:
        residual_batch.start(forward)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, forward, step, cache)
        return self.lm_head(residual_batch.norm(h, forward, self.norm, skip_empty=True))


def build(request: BuildRequest) -> LlamaForCausalLM:
    """This rank's model, refusing a forward until `load_weights` fills it."""
    model = LlamaForCausalLM(request.config, request.parallel, reduction=request.reduction, fusions=request.fusions,
                             dtype=request.dtype, device=request.device)
    return mark_unloaded(model, "this llama model has no weights yet: load them with the family's load_weights(model, source)")


@loads_weights
@torch.no_grad()
def load_weights(model: LlamaForCausalLM, src: TensorSource) -> None:
    """Every weight from Hugging Face names; each parallel layer keeps its rank's shard."""
    ref = model.lm_head.weight

    def get(name):
        return src.require(name).to(dtype=ref.dtype, device=ref.device)

    model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
    model.norm.weight.copy_(get("model.norm.weight"))
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.copy_(get("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        layer.input_layernorm.weight.copy_(get(f"{p}.input_layernorm.weight"))
        layer.post_attention_layernorm.weight.copy_(get(f"{p}.post_attention_layernorm.weight"))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            bias = get(f"{p}.self_attn.{name}.bias") if model.config.attention_bias else None
            getattr(layer.self_attn, name).load_full(get(f"{p}.self_attn.{name}.weight"), bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).load_full(get(f"{p}.mlp.{name}.weight"))


def random_weights(config: LlamaConfig, dtype: torch.dtype, seed: int) -> dict:
    """A seeded state dict with Hugging Face names: linear weights std 1/sqrt(fan_in), norms 1 + 0.1 N."""
    gen = torch.Generator().manual_seed(seed)
    H, D, V, I = config.hidden_size, config.head_dim, config.vocab_size, config.intermediate_size

    def linear(rows, cols):
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=gen)

    state = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen), "model.norm.weight": norm()}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = norm()
        state[f"{p}.post_attention_layernorm.weight"] = norm()
        for name, rows in (("q_proj", config.heads * D), ("k_proj", config.kv_heads * D), ("v_proj", config.kv_heads * D)):
            state[f"{p}.self_attn.{name}.weight"] = linear(rows, H)
            if config.attention_bias:
                state[f"{p}.self_attn.{name}.bias"] = 0.1 * torch.randn(rows, generator=gen)
        state[f"{p}.self_attn.o_proj.weight"] = linear(H, config.heads * D)
        if config.attention_bias:
            state[f"{p}.self_attn.o_proj.bias"] = 0.1 * torch.randn(H, generator=gen)
        state[f"{p}.mlp.gate_proj.weight"] = linear(I, H)
        state[f"{p}.mlp.up_proj.weight"] = linear(I, H)
        state[f"{p}.mlp.down_proj.weight"] = linear(H, I)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
