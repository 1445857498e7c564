"""LongCat-Flash (shortcut-connected MoE), tensor-parallel, with its shortcut as a prepared branch.

Each layer holds two MLA attentions, two dense FFNs and one MoE (Hugging Face's
`LongcatFlashDecoderLayer`):

    r0 = x + attn0(norm0(x))
    main line:  m = MoE(norm1(r0))
    branch:     r1 = r0 + ffn0(norm1(r0)); r2 = r1 + attn1(norm2(r1)); r3 = r2 + ffn1(norm3(r2))
    output:     r3 + m

The main line is an (attention, sparse FFN) stage pair; the branch (dense FFN, attention, dense
FFN) is built with `prepared_from=` the MoE stage, enters through `branch_input()` with the input
the MoE stage already read (so the first branch stage's norm is never applied: it is given the
MoE's), and joins the main line with `branch_output()` + `merge_branch()`. The MoE routes with a
softmax over routed and zero-compute (identity) experts, a score-correction bias for the choice,
and scales the chosen scores by `routed_scaling_factor`; the router runs in fp32, as in HF.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs
import torch
from torch import nn

from layer_boundary import branch_input, branch_output, declare_attn, declare_ffn, layer_stack, make_stages, merge_branch, residual_batch
from layer_boundary import get_forward
from layer_boundary import MoeFinalizeHandoff, reduce_output, shard_cols, shard_rows
from layer_boundary import SumGroup
from layer_boundary import RMSNorm
from .attention import KVCache, RotaryEmbedding, StepLayout
from .config import NO_PIPELINE, ConfigError, FamilyConfig
from .overlapped import run_layers, run_operations
from .mla import TPLatentAttention
from .parts import place_experts
from .pipeline import place_head, place_stage
from .mlp import TPGatedMLP, activation, dense_experts
from layer_boundary.plugin import TensorSource, loads_weights

__all__ = ["LongcatConfig", "LongcatMoE", "LongcatLayer", "LongcatForCausalLM"]

PRESET = {
    "model_type": "longcat_flash",
    "architectures": ["LongcatFlashForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "ffn_hidden_size": 128,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,
    "v_head_dim": 16,
    "moe_topk": 2,
    "n_routed_experts": 8,
    "zero_expert_num": 2,
    "expert_ffn_hidden_size": 32,
    "routed_scaling_factor": 1.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 512,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


@attrs.frozen(kw_only=True)
class LongcatConfig(FamilyConfig):
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_hidden_size: int
    num_experts: int
    zero_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    hidden_act: str

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "LongcatConfig":
        f = cls.fields(raw, "longcat_flash")
        for key in ("attention_bias", "router_bias"):
            if f.bool(key, False):
                raise ConfigError(f"{key}=true is not supported by the LongCat reference model")
        if not f.has("q_lora_rank"):
            raise ConfigError("LongCat-Flash projects queries through q_lora_rank; set it")
        rope = f.sub("rope_parameters")
        rope_type = rope.str("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported; the reference model uses default RoPE")
        heads = f.int("num_attention_heads", 64, min=1)
        if f.int("num_key_value_heads", heads, min=1) != heads:
            raise ConfigError("MLA expands keys and values per head: num_key_value_heads must equal num_attention_heads")
        rope_dim = f.int("qk_rope_head_dim", 64, min=1)
        if f.int("head_dim", 64, min=1) != rope_dim:
            raise ConfigError(f"head_dim sizes the rotary table and must equal qk_rope_head_dim={rope_dim}")
        nope = f.int("qk_nope_head_dim", 128, min=1)
        if f.int("qk_head_dim", nope + rope_dim, min=1) != nope + rope_dim:
            raise ConfigError("qk_head_dim must equal qk_nope_head_dim + qk_rope_head_dim")
        if f.has("num_layers"):
            layers = f.int("num_layers", min=1)
        else:  # Hugging Face counts each of a layer's two attentions
            layers = f.int("num_hidden_layers", 56, min=2) // 2
        ffn_key = f.first(("ffn_hidden_size", "intermediate_size")) or "ffn_hidden_size"
        return cls(
            model_type="longcat_flash",
            architecture=(f.list("architectures", (), of=str) or ("LongcatFlashForCausalLM",))[0],
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=f.int("hidden_size", min=1),
            num_layers=layers,
            num_heads=heads,
            q_lora_rank=f.int("q_lora_rank", min=1),
            kv_lora_rank=f.int("kv_lora_rank", 512, min=1),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.int("v_head_dim", 128, min=1),
            ffn_hidden_size=f.int(ffn_key, 12288, min=1),
            num_experts=f.int("n_routed_experts", 512, min=1),
            zero_experts=f.int("zero_expert_num", 0, min=0),
            top_k=f.int("moe_topk", 12, min=1),
            expert_ffn_hidden_size=f.int("expert_ffn_hidden_size", 2048, min=1),
            routed_scaling_factor=f.float("routed_scaling_factor", 6.0),
            rms_norm_eps=f.float("rms_norm_eps", 1e-5, positive=True),
            rope_theta=rope.float("rope_theta", None, positive=True) or f.float("rope_theta", 10000000.0, positive=True),
            hidden_act=f.str("hidden_act", "silu"),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            hf=dict(raw),
        )

    def check_topology(self, topology) -> None:
        if topology.pp > 1:
            raise ConfigError(NO_PIPELINE.format(model="longcat_flash"))
        if self.num_heads % topology.attn_tp:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by attention TP {topology.attn_tp}")
        if self.ffn_hidden_size % topology.tp:
            raise ConfigError(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by TP {topology.tp}")
        if self.num_experts % topology.moe_ep:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not divisible by moe_ep={topology.moe_ep}")
        if self.expert_ffn_hidden_size % topology.moe_tp:
            raise ConfigError(f"expert_ffn_hidden_size={self.expert_ffn_hidden_size} is not divisible by moe_tp={topology.moe_tp}")


class LongcatMoE(nn.Module):
    """Routed experts over EP x TP plus zero-compute experts that return their input (added on
    TP rank 0 only, so the sum over TP counts them once). Honours the exit's flags."""

    def __init__(self, config: LongcatConfig, parallel, *, dtype=None, device=None):
        super().__init__()
        topo = parallel.topology
        H, total = config.hidden_size, config.num_experts + config.zero_experts
        self.group = parallel.groups["tp"]
        self.adds_identity = parallel.tp_rank == 0
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.scaling = config.routed_scaling_factor
        self.router = nn.Parameter(torch.empty(total, H, dtype=dtype, device=device))
        self.register_buffer("choice_bias", torch.zeros(total, dtype=dtype, device=device))
        per_rank = place_experts(self, parallel, config.num_experts)
        self.width = config.expert_ffn_hidden_size // topo.moe_tp
        self.gate_up = nn.Parameter(torch.empty(per_rank, 2 * self.width, H, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(per_rank, H, self.width, dtype=dtype, device=device))
        self.act = activation(config.hidden_act)

    @torch.no_grad()
    def load_full(self, router, choice_bias, gate_up, down) -> None:
        """router [E + Z, H]; choice_bias [E + Z]; gate_up [>= E, 2I, H] (gate rows first); down [E, H, I]."""
        I = down.shape[-1]
        self.router.copy_(router)
        self.choice_bias.copy_(choice_bias)
        for j, e in enumerate(range(self.first, self.first + self.owned)):
            gate = shard_rows(gate_up[e, :I], self.moe_tp_rank, self.moe_tp)
            up = shard_rows(gate_up[e, I:], self.moe_tp_rank, self.moe_tp)
            self.gate_up[j].copy_(torch.cat((gate, up)))
            self.down[j].copy_(shard_cols(down[e], self.moe_tp_rank, self.moe_tp))

    def choose(self, scores: torch.Tensor):
        """(the scores the choice ranks, each row's top_k experts, zero-compute ones included):
        `route` weighs whichever experts this returns, so a routing check can record and pin it."""
        choice = scores + self.choice_bias
        return choice, torch.topk(choice, self.top_k, dim=-1, sorted=False).indices

    def route(self, x: torch.Tensor):
        scores = torch.softmax(nn.functional.linear(x.float(), self.router.float()), dim=-1)
        _, idx = self.choose(scores)
        return scores.gather(1, idx) * self.scaling, idx

    def forward(self, x: torch.Tensor):
        weights, idx = self.route(x)
        rows = x.new_zeros(x.shape[0], self.top_k, x.shape[1])
        if dense_experts(x):  # every owned expert on every row, kept where the router chose it
            for j in range(self.owned):
                gate, up = nn.functional.linear(x, self.gate_up[j]).split(self.width, dim=-1)
                y = nn.functional.linear(self.act(gate) * up, self.down[j])
                rows = rows + (idx == self.first + j).unsqueeze(-1).to(rows.dtype) * y.unsqueeze(1)
            if self.adds_identity:
                rows = torch.where((idx >= self.num_experts).unsqueeze(-1), x.unsqueeze(1), rows)
        else:
            for j in range(self.owned):
                tok, k = torch.where(idx == self.first + j)
                if tok.numel():
                    gate, up = nn.functional.linear(x[tok], self.gate_up[j]).split(self.width, dim=-1)
                    rows[tok, k] = nn.functional.linear(self.act(gate) * up, self.down[j])
            if self.adds_identity:
                tok, k = torch.where(idx >= self.num_experts)
                rows[tok, k] = x[tok]
        if get_forward().defer_moe_finalize:
            return MoeFinalizeHandoff(rows, weights, idx, None, self.group, SumGroup.MOE_OUTPUT)
        return reduce_output((rows * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype), self.group)


class LongcatLayer(nn.Module):
    def __init__(self, config: LongcatConfig, layer_id: int, parallel, *, fusions=None, dtype=None, device=None):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        tp = parallel.groups["tp"]
        self.layer_id = layer_id
        self.self_attn = nn.ModuleList(
            TPLatentAttention(config, parallel, 2 * layer_id + j, dtype=dtype, device=device) for j in (0, 1)
        )
        self.mlps = nn.ModuleList(
            TPGatedMLP(H, config.ffn_hidden_size, tp, config.hidden_act, dtype=dtype, device=device) for _ in (0, 1)
        )
        self.mlp = LongcatMoE(config, parallel, dtype=dtype, device=device)
        self.input_layernorm = nn.ModuleList(RMSNorm(H, eps, dtype=dtype, device=device) for _ in (0, 1))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(H, eps, dtype=dtype, device=device) for _ in (0, 1))
        opts = {"fusions": fusions} if fusions is not None else {}
        sparse = declare_ffn(sparse=True, next_sparse=True)
        self.attn_boundary, self.moe_boundary = make_stages(
            (declare_attn(), self.input_layernorm[0], {**opts, "producer": self.self_attn[0]}),
            (declare_ffn(sparse=True, next_sparse=True), self.post_attention_layernorm[0], opts),
            previous=sparse if layer_id else None,
            terminal=layer_id == config.num_layers - 1,
            label=f"layer{layer_id}",
        )
        self.ffn0_boundary, self.attn1_boundary, self.ffn1_boundary = make_stages(
            (declare_ffn(), self.post_attention_layernorm[0], opts),  # never applied: the MoE stage read the input
            (declare_attn(), self.input_layernorm[1], {**opts, "producer": self.self_attn[1]}),
            (declare_ffn(), self.post_attention_layernorm[1], opts),
            prepared_from=self.moe_boundary.declaration,
            label=f"layer{layer_id}.shortcut",
        )

    def operations(self, hidden_states, forward, step: StepLayout, rope, cache: Optional[KVCache]):
        """The layer as operations; `yield` marks where another microbatch may run."""
        ffn0_b, attn1_b, ffn1_b = self.ffn0_boundary, self.attn1_boundary, self.ffn1_boundary
        h = self._attention(0, self.attn_boundary, hidden_states, forward, step, rope, cache)
        yield
        x = self.moe_boundary.prepare(h, forward)
        shortcut, branch = branch_input(ffn0_b, x, forward)
        with self.moe_boundary.exit(forward) as out:
            moe = self.mlp(x)
        moe = out.finish(moe)
        yield
        with ffn0_b.exit(branch) as out:
            y = self.mlps[0](shortcut)
        h = out.finish(y)
        yield
        h = self._attention(1, attn1_b, h, branch, step, rope, cache)
        yield
        x = ffn1_b.prepare(h, branch)
        with ffn1_b.exit(branch) as out:
            y = self.mlps[1](x)
        h = out.finish(y)
        return merge_branch(moe, branch_output(h, branch), forward)

    def _attention(self, j, boundary, h, forward, step, rope, cache):
        x = boundary.prepare(h, forward)
        if x.shape[0] != 0:
            x = self.self_attn[j](x, step, rope, cache)
        return boundary.finish(x, forward)

    def forward(self, hidden_states, forward, step: StepLayout, rope, cache: Optional[KVCache]):
        return run_operations(self.operations(hidden_states, forward, step, rope, cache))


class LongcatForCausalLM(nn.Module):
    def __init__(self, config: LongcatConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
        super().__init__()
        place_stage(self, config, parallel, dtype=dtype, device=device)  # one stage: it runs without pipeline stages
        H = config.hidden_size
        with layer_stack(parallel, reduction=reduction):
            self.layers = nn.ModuleList(
                LongcatLayer(config, i, parallel, fusions=fusions, dtype=dtype, device=device) for i in range(config.num_layers)
            )
        place_head(self, lambda: RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device), dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta)

    def routed_layers(self) -> list:
        """(layer id, router) of every MoE layer this rank holds, for a routing check: each
        router's `choose(scores) -> (choice scores, experts)` picks its layer's experts."""
        return [(layer.layer_id, layer.mlp) for layer in self.layers]

    def new_cache(self) -> KVCache:
        return KVCache(2 * self.config.num_layers)

    def forward(self, input_ids: torch.Tensor, forward, step: StepLayout, cache: Optional[KVCache] = None) -> torch.Tensor:
        residual_batch.start(forward)
        hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary(step.positions, hidden_states.dtype)
        hidden_states = run_layers(self.layers, hidden_states, forward, step, rope, cache)
        hidden_states = residual_batch.norm(hidden_states, forward, self.norm, skip_empty=True)
        return self.lm_head(hidden_states)


# weights ---------------------------------------------------------------------------------------

_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@loads_weights
@torch.no_grad()
def load_weights(model: LongcatForCausalLM, src: TensorSource) -> None:
    """Copy every weight from Hugging Face names, each rank keeping its shard."""
    ref = model.embed_tokens.weight

    def get(name):
        return src.require(name).to(dtype=ref.dtype, device=ref.device)

    model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
    model.norm.weight.copy_(get("model.norm.weight"))
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.copy_(get("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for j in (0, 1):
            layer.input_layernorm[j].weight.copy_(get(f"{p}.input_layernorm.{j}.weight"))
            layer.post_attention_layernorm[j].weight.copy_(get(f"{p}.post_attention_layernorm.{j}.weight"))
            attn, a = layer.self_attn[j], f"{p}.self_attn.{j}"
            attn.q_a_proj.weight.copy_(get(f"{a}.q_a_proj.weight"))
            attn.kv_a_proj_with_mqa.weight.copy_(get(f"{a}.kv_a_proj_with_mqa.weight"))
            attn.q_a_layernorm.weight.copy_(get(f"{a}.q_a_layernorm.weight"))
            attn.kv_a_layernorm.weight.copy_(get(f"{a}.kv_a_layernorm.weight"))
            attn.q_b_proj.load_full(get(f"{a}.q_b_proj.weight"))
            attn.kv_b_proj.load_full(get(f"{a}.kv_b_proj.weight"))
            attn.o_proj.load_full(get(f"{a}.o_proj.weight"))
            m = f"{p}.mlps.{j}"
            layer.mlps[j].load_full(get(f"{m}.gate_proj.weight"), get(f"{m}.up_proj.weight"), get(f"{m}.down_proj.weight"))
        layer.mlp.load_full(
            get(f"{p}.mlp.router.classifier.weight"),
            get(f"{p}.mlp.router.e_score_correction_bias"),
            get(f"{p}.mlp.experts.gate_up_proj"),
            get(f"{p}.mlp.experts.down_proj"),
        )


def random_weights(config: LongcatConfig, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names and shapes (transformers 5 layout).

    Linear weights have std 1/sqrt(fan_in), embeddings std 1, norm weights 1 + 0.1 N(0, 1), the
    choice bias 0.05 N(0, 1): every weight matters and a missing or doubled sum shows.
    """
    gen = torch.Generator().manual_seed(seed)
    H, V = config.hidden_size, config.vocab_size
    heads, qk = config.num_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    E, Z, I, F = config.num_experts, config.zero_experts, config.expert_ffn_hidden_size, config.ffn_hidden_size

    def linear(out_f, in_f, *lead):
        return torch.randn(*lead, out_f, in_f, generator=gen) / in_f**0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    state = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        for j in (0, 1):
            a = f"{p}.self_attn.{j}"
            state[f"{a}.q_a_proj.weight"] = linear(config.q_lora_rank, H)
            state[f"{a}.q_a_layernorm.weight"] = norm(config.q_lora_rank)
            state[f"{a}.q_b_proj.weight"] = linear(heads * qk, config.q_lora_rank)
            state[f"{a}.kv_a_proj_with_mqa.weight"] = linear(config.kv_lora_rank + config.qk_rope_head_dim, H)
            state[f"{a}.kv_a_layernorm.weight"] = norm(config.kv_lora_rank)
            state[f"{a}.kv_b_proj.weight"] = linear(heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)
            state[f"{a}.o_proj.weight"] = linear(H, heads * config.v_head_dim)
            state[f"{p}.mlps.{j}.gate_proj.weight"] = linear(F, H)
            state[f"{p}.mlps.{j}.up_proj.weight"] = linear(F, H)
            state[f"{p}.mlps.{j}.down_proj.weight"] = linear(H, F)
            state[f"{p}.input_layernorm.{j}.weight"] = norm(H)
            state[f"{p}.post_attention_layernorm.{j}.weight"] = norm(H)
        state[f"{p}.mlp.router.classifier.weight"] = linear(E + Z, H)
        state[f"{p}.mlp.router.e_score_correction_bias"] = 0.05 * torch.randn(E + Z, generator=gen)
        # HF keeps gate_up rows for the zero-compute experts too (unused)
        state[f"{p}.mlp.experts.gate_up_proj"] = linear(2 * I, H, E + Z)
        state[f"{p}.mlp.experts.down_proj"] = linear(H, I, E)
    state["model.norm.weight"] = norm(H)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
