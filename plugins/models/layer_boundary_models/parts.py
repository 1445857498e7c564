"""Pieces the reference families share: the output head (tied to the embedding where the config
says so) and where this rank's routed experts sit."""

from __future__ import annotations

from torch import nn

__all__ = ["output_head", "place_experts"]


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
