"""DeepSeek-V4's MoE FFN over EP x TP: score-function routing with a selection bias, routed
scaling, clamped SwiGLU experts, and one always-on shared expert.

Each rank computes the experts it owns (EP) on its share of their width (TP) for every token of
the full rows, plus its TP share of the shared expert; the partial outputs sum over the TP group
(the boundary's MOE_OUTPUT sum, honouring the exit's flags). Hash routing (`hash_moe` layers)
is not implemented; the config parser rejects it.
"""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import reduce_output, shard_cols, shard_rows
from .parts import place_experts
from .mlp import activation, dense_experts

__all__ = ["DeepseekV4MoE", "score_function"]


def score_function(name: str):
    if name == "sqrtsoftplus":
        return lambda logits: nn.functional.softplus(logits).sqrt()
    if name == "sigmoid":
        return torch.sigmoid
    if name == "softmax":
        return lambda logits: torch.softmax(logits, dim=-1)
    raise ValueError(f"scoring_func {name!r} is not supported; use sqrtsoftplus, sigmoid or softmax")


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, parallel, *, dtype=None, device=None):
        super().__init__()
        topo = parallel.topology
        H = config.hidden_size
        self.group = parallel.groups["tp"]
        self.top_k = config.top_k
        self.scaling = config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.score = score_function(config.scoring_func)
        self.act = activation(config.hidden_act)
        self.router = nn.Parameter(torch.empty(config.num_experts, H, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(config.num_experts, dtype=dtype, device=device))
        per_rank = place_experts(self, parallel, config.num_experts)
        self.width = config.moe_intermediate_size // topo.moe_tp
        self.gate_up = nn.Parameter(torch.empty(per_rank, 2 * self.width, H, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(per_rank, H, self.width, dtype=dtype, device=device))
        self.shared_width = config.moe_intermediate_size // self.group.size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * self.shared_width, H, dtype=dtype, device=device))
        self.shared_down = nn.Parameter(torch.empty(H, self.shared_width, dtype=dtype, device=device))

    def load(self, src, prefix: str, to) -> None:
        gate_up, down = to(src.require(f"{prefix}.experts.gate_up_proj")), to(src.require(f"{prefix}.experts.down_proj"))
        I = gate_up.shape[1] // 2
        r, s = self.moe_tp_rank, self.moe_tp
        tr, ts = self.group.rank, self.group.size
        with torch.no_grad():
            self.router.copy_(to(src.require(f"{prefix}.gate.weight")))
            self.bias.copy_(to(src.require(f"{prefix}.gate.e_score_correction_bias")))
            for j in range(self.owned):
                e = self.first + j
                self.gate_up[j].copy_(torch.cat((shard_rows(gate_up[e, :I], r, s), shard_rows(gate_up[e, I:], r, s))))
                self.down[j].copy_(shard_cols(down[e], r, s))
            p = f"{prefix}.shared_experts"
            gate = shard_rows(to(src.require(f"{p}.gate_proj.weight")), tr, ts)
            up = shard_rows(to(src.require(f"{p}.up_proj.weight")), tr, ts)
            self.shared_gate_up.copy_(torch.cat((gate, up)))
            self.shared_down.copy_(shard_cols(to(src.require(f"{p}.down_proj.weight")), tr, ts))

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scores the choice ranks, each row's top_k experts): the bias steers the choice,
        not the weights; `route` weighs whichever experts this returns (a routing check pins it)."""
        choice = scores + self.bias
        return choice, torch.topk(choice, self.top_k, dim=-1, sorted=False).indices

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k])."""
        scores = self.score(nn.functional.linear(x, self.router))
        _, chosen = self.choose(scores)
        weights = scores.gather(1, chosen)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, chosen

    def _swiglu(self, gate_up: torch.Tensor, width: int) -> torch.Tensor:
        gate, up = gate_up.split(width, dim=-1)
        return self.act(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        dense = dense_experts(x)
        for j in range(self.owned):
            if dense:  # every token through expert j, weighted by its weight for j (zero if not chosen)
                h = self._swiglu(nn.functional.linear(x, self.gate_up[j]), self.width)
                w = (weights * (chosen == self.first + j).to(weights.dtype)).sum(dim=1, keepdim=True)
                out = out + nn.functional.linear(h, self.down[j]) * w
                continue
            tok, k = torch.where(chosen == self.first + j)
            if tok.numel() == 0:
                continue
            h = self._swiglu(nn.functional.linear(x[tok], self.gate_up[j]), self.width)
            out.index_add_(0, tok, nn.functional.linear(h, self.down[j]) * weights[tok, k, None])
        shared = self._swiglu(nn.functional.linear(x, self.shared_gate_up), self.shared_width)
        return reduce_output(out + nn.functional.linear(shared, self.shared_down), self.group)
