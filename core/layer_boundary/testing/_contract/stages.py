"""The stages a provider is asked about: real boundaries built in context (what the consumer's
input may owe, which norm reads it), and the frozen descriptions of them."""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import torch

from ..._factories import declare_attn, declare_ffn, make_stages
from ..._output import OutputTransform
from ..._parallel import Parallel
from ..._residual.add_norm import GemmaRMSNorm, LayerNorm, RMSNorm
from .report import ContractSettings


def device_of(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


@attrs.frozen
class Situation:
    """A consumer stage in context; `boundary(parallel, norm_of)` builds it (`norm_of()` a read
    norm, `norm_of(post=True)` a producer's output norm)."""

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


def _post_norm(norm_of) -> OutputTransform:
    return OutputTransform(norm_of(post=True), name="post_norm")


def _ffn_after_post_norm_attention(parallel, norm_of, label):
    """A sandwich (or post-norm) layer's FFN input: the attention's sum arrives owing its output norm."""
    _, ffn = make_stages((declare_attn(output_transform=_post_norm(norm_of)), norm_of()),
                         (declare_ffn(output_transform=_post_norm(norm_of)), norm_of()), following=declare_attn(),
                         parallel=parallel, reduction="ar", label=label)
    return ffn


def _attention_after_post_norm_ffn(parallel, norm_of, label):
    """The next layer's attention input: the FFN's deferred sum arrives owing its output norm."""
    attn, _ = make_stages((declare_attn(output_transform=_post_norm(norm_of)), norm_of()),
                          (declare_ffn(output_transform=_post_norm(norm_of)), norm_of()),
                          previous=declare_ffn(output_transform=_post_norm(norm_of)), terminal=True, parallel=parallel,
                          reduction="ar", label=label)
    return attn


SITUATIONS = (
    Situation("ffn_after_attention", _ffn_after_attention, ("declared",)),
    Situation("moe_after_attention", functools.partial(_ffn_after_attention, sparse=True), ("declared",)),
    Situation("attention_after_ffn", _attention_after_ffn, ("deferred",)),
    Situation("attention_after_moe", functools.partial(_attention_after_ffn, sparse=True, terminal=False),
              ("deferred", "handoff")),
    Situation("attention_at_entry", _attention_at_entry, ()),
    Situation("attention_after_scaled_ffn", _attention_after_scaled_ffn, ()),
    Situation("ffn_after_post_norm_attention", _ffn_after_post_norm_attention, ("declared",)),
    Situation("attention_after_post_norm_ffn", _attention_after_post_norm_ffn, ("deferred",)),
)
#: the read norms of every situation: RMSNorm, Gemma's, LayerNorm (with a bias), the identity
#: (a post-norm layer's read) and a norm no kernel computes
NORM_KINDS = ("rms", "gemma_rms", "layer", "none", "other")
#: the output norm a post-norm situation's producer owes, by the read's kind: Gemma's sandwich,
#: OLMo-2's RMSNorm before an identity read, LayerNorm around LayerNorm
POST_NORM_KINDS = {"rms": "rms", "gemma_rms": "gemma_rms", "layer": "layer", "none": "rms", "other": "rms"}


class _OtherNorm(torch.nn.Module):
    """A norm that is not an RMSNorm (LayerNorm without bias): no fused candidate applies."""

    def __init__(self, hidden, dtype, device):
        super().__init__()
        self.inner = torch.nn.LayerNorm(hidden, bias=False, dtype=dtype, device=device)
        self.hidden_size = hidden  # what the boundary checks compute outputs against

    def forward(self, x):
        return self.inner(x)


class Identity(torch.nn.Module):
    """A read that normalizes nothing (a post-norm layer's), naming its width."""

    norm_kind = "none"

    def __init__(self, hidden):
        super().__init__()
        self.hidden_size = hidden

    def forward(self, x):
        return x


def make_norm(kind: str, hidden: int, dtype, device, seed: int, *, post: bool = False):
    """A norm of `kind` with weights away from their defaults; `post=True`: the output norm a
    post-norm producer owes before a read of `kind` (`POST_NORM_KINDS`)."""
    if post:
        kind, seed = POST_NORM_KINDS[kind], seed + 101
    gen = torch.Generator().manual_seed(seed)
    if kind == "other":
        return _OtherNorm(hidden, dtype, device)
    if kind == "none":
        return Identity(hidden)
    if kind == "layer":
        norm = LayerNorm(hidden, 1e-5, bias=True, dtype=dtype, device=device)
        with torch.no_grad():
            norm.weight.copy_(1.0 + 0.25 * torch.randn(hidden, generator=gen, dtype=torch.float64).to(dtype))
            norm.bias.copy_(0.25 * torch.randn(hidden, generator=gen, dtype=torch.float64).to(dtype))
        return norm
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
                boundary = situation.boundary(parallel, lambda post=False: make_norm(kind, settings.hidden_size, torch.float32, "cpu", 0,
                                                                                     post=post))
                out.append(boundary.plan.description)
    return out
