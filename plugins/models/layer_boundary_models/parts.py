"""Pieces the reference families share: the output head (tied to the embedding where the config
says so) and where this rank's routed experts sit."""

from __future__ import annotations

from torch import nn

__all__ = ["output_head", "place_experts", "TwoStageLayer"]


def output_head(config, embed_tokens=None, *, dtype=None, device=None) -> nn.Linear:
    """The replicated LM head; it shares the embedding's weight when the config ties them (and
    this stage holds the embedding)."""
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
    if config.tie_word_embeddings and embed_tokens is not None:
        head.weight = embed_tokens.weight
    return head


def place_experts(module: nn.Module, parallel, num_experts: int) -> int:
    """Set `module.first` and `module.owned` (this rank's expert range over expert parallelism)
    and `module.moe_tp_rank` / `module.moe_tp` (its share of each expert's width); returns the
    experts a rank holds."""
    topo = parallel.topology
    per_rank = num_experts // topo.moe_ep
    module.first, module.owned = parallel.moe_ep_rank * per_rank, per_rank
    module.moe_tp_rank, module.moe_tp = parallel.moe_tp_rank, topo.moe_tp
    return per_rank


class TwoStageLayer(nn.Module):
    """A decoder layer of two stages, attention then its FFN, each run through its boundary
    (`attn_boundary`, `ffn_boundary`) around its compute (`self_attn`, `mlp`), which a subclass
    builds; `operations` is the layer for two-batch overlap."""

    def forward(self, hidden_states, forward, step, rope, cache):
        hidden_states = self.attention(hidden_states, forward, step, rope, cache)
        return self.feed_forward(hidden_states, forward)

    def attention(self, hidden_states, forward, step, rope, cache):
        hidden_states = self.attn_boundary.prepare(hidden_states, forward)
        if hidden_states.shape[0] != 0 or forward.cp is not None:  # a CP rank joins the KV gather even with no rows
            cp = {} if forward.cp is None else {"cp": forward.cp}
            hidden_states = self.self_attn(hidden_states, step, rope, cache, **cp)
        return self.attn_boundary.finish(hidden_states, forward)

    def feed_forward(self, hidden_states, forward):
        hidden_states = self.ffn_boundary.prepare(hidden_states, forward)
        with self.ffn_boundary.exit(forward) as output:
            hidden_states = self.mlp(hidden_states)
        return output.finish(hidden_states)

    def operations(self, hidden_states, forward, step, rope, cache):
        """The layer for two-batch overlap: `yield` between its stages (no exit scope is open there)."""
        hidden_states = self.attention(hidden_states, forward, step, rope, cache)
        yield
        return self.feed_forward(hidden_states, forward)
