"""The stages a provider is asked about: real boundaries built in context (what the consumer's
input may owe, which norm reads it), and the frozen descriptions of them."""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import torch

from ..._factories import declare_attn, declare_ffn, make_stages
from ..._parallel import Parallel
from ..._residual.add_norm import GemmaRMSNorm, RMSNorm
from .report import ContractSettings


def device_of(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


@attrs.frozen
class Situation:
    """A consumer stage in context; `boundary(parallel, norm_of)` builds it."""

    name: str
    build: Callable
    #: owed values the consumer's input receives: "declared", "deferred", "handoff"
    owed: tuple

    def boundary(self, parallel, norm_of):
        return self.build(parallel, norm_of, self.name)


def _ffn_after_attention(parallel, norm_of, label, sparse=False):
    _, ffn = make_stages((declare_attn(), norm_of()), (declare_ffn(sparse=sparse), norm_of()), following=declare_attn(),
                         parallel=parallel, reduction="ar", label=label)
    return ffn


def _attention_after_ffn(parallel, norm_of, label, sparse=False, terminal=True):
    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()), previous=declare_ffn(sparse=sparse),
                          terminal=terminal, parallel=parallel, reduction="ar", label=label)
    return attn


def _attention_at_entry(parallel, norm_of, label):
    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()), terminal=True, parallel=parallel,
                          reduction="ar", label=label)
    return attn


def _attention_after_scaled_ffn(parallel, norm_of, label):
    class HalfUpdate:  # a non-plain update: the core never offers candidates here
        plain_add, at_producer, outlives_layer = False, False, True

        def apply(self, contribution, residual):
            return (contribution + residual) * 0.5

    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()),
                          previous=declare_ffn(update=HalfUpdate()), terminal=True, parallel=parallel, reduction="ar",
                          label=label)
    return attn


SITUATIONS = (
    Situation("ffn_after_attention", _ffn_after_attention, ("declared",)),
    Situation("moe_after_attention", functools.partial(_ffn_after_attention, sparse=True), ("declared",)),
    Situation("attention_after_ffn", _attention_after_ffn, ("deferred",)),
    Situation("attention_after_moe", functools.partial(_attention_after_ffn, sparse=True, terminal=False),
              ("deferred", "handoff")),
    Situation("attention_at_entry", _attention_at_entry, ()),
    Situation("attention_after_scaled_ffn", _attention_after_scaled_ffn, ()),
)
NORM_KINDS = ("rms", "gemma_rms", "other")


class _OtherNorm(torch.nn.Module):
    """A norm that is not an RMSNorm (LayerNorm without bias): no fused candidate applies."""

    def __init__(self, hidden, dtype, device):
        super().__init__()
        self.inner = torch.nn.LayerNorm(hidden, bias=False, dtype=dtype, device=device)
        self.hidden_size = hidden  # what the boundary checks compute outputs against

    def forward(self, x):
        return self.inner(x)


def make_norm(kind: str, hidden: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "other":
        return _OtherNorm(hidden, dtype, device)
    norm = (RMSNorm if kind == "rms" else GemmaRMSNorm)(hidden, 1e-6, dtype=dtype, device=device)
    with torch.no_grad():  # weights away from 1 (and 0 for Gemma) so a misread weight shows
        base = 1.0 if kind == "rms" else 0.0
        norm.weight.copy_(base + 0.25 * torch.randn(hidden, generator=gen, dtype=torch.float64).to(dtype))
    return norm


class _NoCollectives:
    """Groups of a world that does not exist: construction must not need one."""

    def __init__(self, name, ranks):
        self.name, self.ranks, self.size, self.rank = name, tuple(ranks), len(ranks), 0

    def __getattr__(self, op):
        if op not in ("all_reduce", "reduce_scatter", "reduce_scatterv", "all_gather", "all_gatherv"):
            raise AttributeError(op)
        raise RuntimeError(f"{op} over {self.name} during stage construction; construction must not run a collective")


def stage_descriptions(settings: ContractSettings) -> list:
    """Every (situation, norm kind, topology) description a factory is asked about, built with the
    core's own providers only (so no plugin factory runs while describing)."""
    out = []
    for topology in settings.topologies + settings.described_topologies:
        parallel = Parallel.create(topology, 0, _NoCollectives)
        for situation in SITUATIONS:
            for kind in NORM_KINDS:
                boundary = situation.boundary(parallel, lambda: make_norm(kind, settings.hidden_size, torch.float32, "cpu", 0))
                out.append(boundary.plan.description)
    return out
