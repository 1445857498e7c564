"""Routed experts over EP x TP (Qwen3-MoE routing), with an optional shared expert.

Each rank computes the experts it owns (EP) on its share of their width (TP) for every token
of the full rows; the partial outputs sum over the TP group. The sum honours the exit's flags,
and when the exit publishes `defer_moe_finalize` the weighted combine is handed off unfinalized.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import get_forward
from layer_boundary import MoeFinalizeHandoff, reduce_output, shard_cols, shard_rows
from layer_boundary import SumGroup
from .parts import place_experts
from .mlp import TPGatedMLP, activation, dense_experts

__all__ = ["TPMoE"]


class TPMoE(nn.Module):
    def __init__(self, config, parallel, *, dtype=None, device=None):
        super().__init__()
        topo = parallel.topology
        self.group = parallel.groups["tp"]
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype, device=device))
        per_rank = place_experts(self, parallel, config.num_experts)
        width = config.moe_intermediate_size // topo.moe_tp
        self.width = width
        H = config.hidden_size
        self.gate_up = nn.Parameter(torch.empty(per_rank, 2 * width, H, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(per_rank, H, width, dtype=dtype, device=device))
        self.act = activation(config.hidden_act)
        self.shared: Optional[TPGatedMLP] = None
        self.shared_gate = None
        if config.shared_expert_intermediate_size:
            self.shared = TPGatedMLP(H, config.shared_expert_intermediate_size, self.group, config.hidden_act, reduce_results=False, dtype=dtype, device=device)
            self.shared_gate = nn.Parameter(torch.empty(1, H, dtype=dtype, device=device))

    def load_full(self, router, gate_up, down, shared=None) -> None:
        """router [E, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]."""
        I = gate_up.shape[1] // 2
        sl = slice(self.first, self.first + self.owned)
        with torch.no_grad():
            self.router.copy_(router)
            for j, e in enumerate(range(sl.start, sl.stop)):
                gate = shard_rows(gate_up[e, :I], self.moe_tp_rank, self.moe_tp)
                up = shard_rows(gate_up[e, I:], self.moe_tp_rank, self.moe_tp)
                self.gate_up[j].copy_(torch.cat((gate, up)))
                self.down[j].copy_(shard_cols(down[e], self.moe_tp_rank, self.moe_tp))
            if shared is not None and self.shared is not None:
                gate, up, dn, shared_gate = shared
                self.shared.load_full(gate, up, dn)
                self.shared_gate.copy_(shared_gate)

    def choose(self, probs: torch.Tensor):
        """(the scores the choice ranks, each row's top_k experts): the one place this layer picks
        experts; `route` weighs whichever it returns, so a routing check can record and pin it."""
        return probs, torch.topk(probs, self.top_k, dim=-1).indices

    def route(self, x: torch.Tensor):
        logits = nn.functional.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        _, idx = self.choose(probs)
        weights = probs.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), idx

    #: up to this many tokens every owned expert runs on every token (no host sync, graph-capturable)
    DENSE_DISPATCH_TOKENS = 32

    def _expert(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.gate_up[j]).split(self.width, dim=-1)
        return nn.functional.linear(self.act(gate) * up, self.down[j])

    def forward(self, x: torch.Tensor):
        weights, idx = self.route(x)
        rows = x.new_zeros(x.shape[0], self.top_k, x.shape[1])
        dense = dense_experts(x) or x.shape[0] <= self.DENSE_DISPATCH_TOKENS
        for j in range(self.owned):
            if dense:
                # the same rows as the sparse path: each (token, k) matches one expert, others add zeros
                y = self._expert(j, x)
                rows += (idx == self.first + j).unsqueeze(-1).to(x.dtype) * y.unsqueeze(1)
                continue
            tok, k = torch.where(idx == self.first + j)
            if tok.numel() == 0:
                continue
            rows[tok, k] = self._expert(j, x[tok])
        shared = None
        if self.shared is not None:
            shared = self.shared(x) * torch.sigmoid(nn.functional.linear(x, self.shared_gate))
        if get_forward().defer_moe_finalize:
            return MoeFinalizeHandoff(rows, weights, idx, shared, self.group, SumGroup.MOE_OUTPUT)
        out = (rows * weights.unsqueeze(-1)).sum(dim=1)
        if shared is not None:
            out = out + shared
        return reduce_output(out, self.group)
