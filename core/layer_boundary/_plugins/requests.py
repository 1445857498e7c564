"""The typed requests each extension point's factory receives, and the capabilities (typed
Protocols) of the objects factories return.

Requests are frozen and built by the core; a factory reads them and never keeps a mutable
reference into the core. Capabilities are checked once, at construction, with `isinstance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import types

import attrs

if TYPE_CHECKING:  # annotations only: importing this module stays cheap
    import torch

    from .._forward import Forward, RowLayout
    from .._planning import Stage, StagePath
    from .._stage import StageBoundary



# requests --------------------------------------------------------------------------------------


def _read_only(mapping) -> types.MappingProxyType:
    """A read-only copy of `mapping` (None: empty): what a request carries of the engine's values."""
    return types.MappingProxyType(dict(mapping or {}))


@attrs.frozen
class CpPathRequest:
    """A stage's facts and its ordinary path, from which its context-parallel path derives."""

    stage: "Stage"
    ordinary: "StagePath"


@attrs.frozen
class TokenMappingRequest:
    """One context-parallel batch: the new tokens of every request, in batch row order."""

    parallel: Any
    lengths: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(n) for n in v))
    order: Optional[str] = None  #: the plugin's token order ("zigzag", "contiguous"); None: its default
    device: Any = None


class OverlapRequest(NamedTuple):
    """The process's two-batch-overlap scheduler is asked for once per registry, for every batch
    (the batch itself goes to `Overlap.run`); no fields yet."""


@attrs.frozen
class BranchRequest:
    """The boundary a prepared branch enters (`branch_input`), or None (`branch_output`,
    `merge_branch`)."""

    boundary: Optional["StageBoundary"] = None


@attrs.frozen
class RowPublisherRequest:
    """The stage whose compute rows are to be published."""

    stage: "Stage"


@attrs.frozen(kw_only=True)
class AddNormRequest:
    """What a local add + norm kernel is asked to run: rows of `hidden_size` elements, the sum
    `contribution + residual` in fp32 rounded once into the new residual, and the norm of the
    unrounded sum with its statistic in `compute_dtype`, on `device`. `dtype` is the residual's
    (and the outputs'), `contribution_dtype` and `weight_dtype` those of the other two inputs.
    `norm_kind` is "rms" (`sum * rsqrt(mean(sum^2) + eps) * (weight + offset)`, offset 0),
    "gemma_rms" (offset 1, the weight is the raw `w` of `1 + w`) or "layer" (LayerNorm:
    `(sum - mean) * rsqrt(var + eps) * weight (+ bias)`; `bias` says whether it has one, and its
    kernel takes it as a fourth argument, None without one)."""

    device: "torch.device"
    dtype: "torch.dtype"
    contribution_dtype: "torch.dtype"
    weight_dtype: "torch.dtype"
    hidden_size: int
    offset: float
    eps: float
    compute_dtype: "torch.dtype"
    norm_kind: str
    bias: bool = False

    @property
    def uniform_dtype(self) -> Optional["torch.dtype"]:
        """The one dtype of residual, contribution and weight, or None when they differ."""
        same = self.dtype == self.contribution_dtype == self.weight_dtype
        return self.dtype if same else None


@attrs.frozen(kw_only=True)
class NormSpec:
    """One norm of a `PostNormRequest`: its kind ("rms", "gemma_rms", "layer"; the read's may be
    "none", the identity), the dtype of its weight (None for "none"), its weight offset (1 for
    "gemma_rms"), epsilon, statistic dtype and whether it has a bias (LayerNorm)."""

    norm_kind: str
    weight_dtype: Optional["torch.dtype"] = None
    offset: float = 0.0
    eps: float = 0.0
    compute_dtype: Optional["torch.dtype"] = None
    bias: bool = False


@attrs.frozen(kw_only=True)
class PostNormRequest:
    """What a local post-norm + add + norm kernel is asked to run on `device`, rows of
    `hidden_size` elements: a complete output `contribution` (`contribution_dtype`) that owes its
    producer's output norm `post`, the residual and both outputs in `dtype`:

    1. `post_out = post(contribution)`, the statistic in `post.compute_dtype`, rounded once to
       `dtype` (as the unfused path hands it on);
    2. `total = residual + post_out` in fp32, rounded once into the new residual;
    3. `normed = norm(total)` from the unrounded sum, as an `AddNormRequest` of `norm` describes;
       where `norm.norm_kind` is "none" (a read that normalizes nothing) the compute input is the
       new residual itself.

    The kernel is `kernel(contribution, residual, post_weight, post_bias, weight, bias) ->
    (normed, new_residual)`: the biases None where the norm has none, `weight` and `bias` None for
    the identity read, which returns the new residual twice."""

    device: "torch.device"
    dtype: "torch.dtype"
    contribution_dtype: "torch.dtype"
    hidden_size: int
    post: NormSpec
    norm: NormSpec

    @property
    def uniform_dtype(self) -> Optional["torch.dtype"]:
        """The one dtype of residual, contribution and every weight, or None when they differ."""
        weights = {self.post.weight_dtype} | ({self.norm.weight_dtype} if self.norm.norm_kind != "none" else set())
        same = self.dtype == self.contribution_dtype and weights == {self.dtype}
        return self.dtype if same else None


@attrs.frozen
class RopeRequest:
    """What a rotary kernel is asked to run: the half-split ("neox") rotation of every head of
    queries [tokens, heads, head_dim] and keys [tokens, kv_heads, head_dim] by the angles
    `position * theta ** (-2i / head_dim)`, for positions below `max_positions`, on `device` in
    `dtype`. Asked once per model (`prepare_model`)."""

    device: "torch.device"
    dtype: "torch.dtype"
    head_dim: int
    heads: int
    kv_heads: int
    theta: float
    max_positions: int


@attrs.frozen
class QKNormRopeRequest(RopeRequest):
    """What a fused q/k norm + rotary kernel is asked to run (Qwen3's `q_norm` / `k_norm`, then the
    rope), on `device` in `dtype`, for every head row of queries [tokens, heads, head_dim] and keys
    [tokens, kv_heads, head_dim]:

    1. RMSNorm over head_dim with the row's own weight (`q_weight` for queries, `k_weight` for
       keys): `weight * (x * rsqrt(mean(x^2) + eps))`, the statistic in fp32 and the plain
       weight (no `1 + weight` offset). The core's `RMSNorm` rounds the normalized row to `dtype`
       before the weight multiplies it; a kernel may instead round once after it, as FlashInfer's
       `rmsnorm` (the unfused path where the flashinfer plugin is installed) does: the two differ
       by a unit in the last place;
    2. the half-split ("neox") rotation of the normalized row by the angles
       `position * theta ** (-2i / head_dim)`, as `RopeRequest` describes, for positions below
       `max_positions`.

    Asked once per model (`prepare_model`), only for attentions that have q/k norms. Its fields
    are a `RopeRequest`'s and the norms' `eps`."""

    eps: float


@attrs.frozen
class DecodeAttentionRequest:
    """What a decode-attention kernel is asked to run: one query token per row, [tokens, heads,
    head_dim], against a static cache [slots, kv_heads, max_len, head_dim] per layer (keys and
    values; `heads` a multiple of `kv_heads`, each KV head shared by its group of query heads),
    scores scaled by `scaling`, softmax over positions 0..position of the row. Asked once per
    model (`prepare_model`)."""

    device: "torch.device"
    dtype: "torch.dtype"
    head_dim: int
    heads: int
    kv_heads: int
    scaling: float


#: the activations a gated MLP names (`GatedActivationRequest.activation`): SiLU, GELU with the
#: tanh approximation, exact (erf) GELU, squared ReLU
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2")


@attrs.frozen
class GatedActivationRequest:
    """What a gated-activation kernel is asked to run: `act(gate) * up` over rows of
    `intermediate` elements (this rank's share of the MLP width) on `device` in `dtype`, where
    the input row holds gate then up (2 * intermediate elements). `activation` is one of
    `GATED_ACTIVATIONS` ("gelu_tanh" also stands for Hugging Face's "gelu_pytorch_tanh").
    Asked once per model and distinct width (`prepare_model`)."""

    device: "torch.device"
    dtype: "torch.dtype"
    activation: str
    intermediate: int


@attrs.frozen
class PrepareRequest:
    """`prepare_model(model, max_tokens=...)`: a model whose weights are in place, before its
    first forward and before any CUDA-graph capture. Called on every rank."""

    model: Any
    #: the largest token count one forward will carry (sizes workspaces)
    max_tokens: int
    #: the engine's per-plugin settings, keyed by plugin name (`{"flashinfer": FlashInferSettings(...)}`);
    #: identical on every rank
    settings: Any = attrs.field(factory=dict, converter=_read_only)


@attrs.frozen(kw_only=True)
class BuildRequest:
    """What a `ModelFamily` factory builds: this rank's model of `config` (the family's parsed
    config) for `parallel`, its stages planned with the reduction policy `reduction` and the
    stages' explicit `fusions=` provider, its weights uninitialised on `device` in `dtype`
    (`device="meta"`: planning only). `options` are the run options the family declared it
    supports (`ModelFamily.options`), with their values: "lora" (adapter count) and
    "lora_seed", "fp8" ("dynamic" or "static"), "tbo", "sequence_parallel"."""

    config: Any
    parallel: Any
    reduction: Any = "ar"
    fusions: Any = None
    dtype: Any = None
    device: Any = None
    options: Any = attrs.field(factory=dict, converter=_read_only)


@attrs.frozen(kw_only=True)
class ReferenceRequest:
    """What a `ModelFamily.reference` builds: the unsharded Hugging Face model the run is checked
    against, of `config` (the family's parsed config), in `dtype`, holding exactly the run's
    weights, for `requests` requests with the run's `options` (as in `BuildRequest`).
    `hf_model(fit_state=None, **from_config_options)` builds it the default way: the config's
    `model_type` causal LM with eager attention and eager experts (the options override those),
    holding the state dict strictly (`fit_state(state, model)`, when given, first returns the
    state in the layout the installed transformers built) or loaded from the checkpoint folder;
    a family adjusts or wraps it."""

    config: Any
    dtype: Any
    hf_model: Callable[..., Any]
    requests: int = 0
    options: Any = attrs.field(factory=dict, converter=_read_only)


@attrs.frozen
class HfReference:
    """A reference model (called like a Hugging Face causal LM: `model(input_ids, cache=...,
    use_cache=True)`, the cache under whichever of `cache` and `past_key_values` its forward
    names) and, per request, extra keyword arguments of its calls (peft's `adapter_names`, say),
    or None. `tolerance`: the relative error this reference reproduces the family's arithmetic
    to, where the installed release computes it less exactly than the family's `tolerances` say
    (its float32 steps summed in another order, say); None: the family's."""

    model: Any
    request_kwargs: Optional[tuple] = None
    tolerance: Optional[float] = None


@attrs.frozen
class ReleaseRequest:
    """`release_model(model)`: free what prepare made, on every rank, before the process
    groups are destroyed."""

    model: Any


# capabilities -----------------------------------------------------------------------------------


@runtime_checkable
class AttentionInputFusion(Protocol):
    """A fusion provider's consumer candidates for an attention (or mixer) input, asked once
    when the stage is planned: `FusedMlpInput` values (or bare callables), in order."""

    def attention_input(self, stage: "Stage") -> Sequence[Any]: ...


@runtime_checkable
class FfnInputFusion(Protocol):
    """The same for an FFN input."""

    def ffn_input(self, stage: "Stage") -> Sequence[Any]: ...


@runtime_checkable
class DefersFinalize(Protocol):
    """May this FFN's MoE return its unfinalized output (a `HandoffOutput`) for a fused
    consumer? Asked per batch; the answer must be the same on every rank."""

    def can_defer_finalize(self, plan: Any, forward: "Forward") -> bool: ...


@runtime_checkable
class DefersAllReduce(Protocol):
    """May an FFN whose sum is not one all-reduce (LoRA, a TP=1 shared expert) leave it to the
    next input? Asked per batch; the answer must be the same on every rank."""

    def can_defer_all_reduce(self, plan: Any, forward: "Forward") -> bool: ...


@runtime_checkable
class CpTokenMapping(Protocol):
    """What the core needs of a context-parallel batch's token mapping (`Forward(cp=...)`):
    this rank's rows of the batch's token-order rows, and back (a collective over attention CP)."""

    num_local: int

    def take_local(self, x: "torch.Tensor") -> "torch.Tensor": ...

    def gather(self, x: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class Overlap(Protocol):
    """`two_batch_overlap(forward)`: runs a model's stages as two interleaved microbatches."""

    def run(self, stages: Any, hidden_states: Any, forward: "Forward", **options: Any) -> Any: ...


@runtime_checkable
class BranchTransport(Protocol):
    """`branch_input` / `branch_output` / `merge_branch` of prepared branches."""

    def branch_input(self, boundary: "StageBoundary", hidden_states: Any, forward: "Forward") -> tuple[Any, "Forward"]: ...

    def branch_output(self, hidden_states: Any, branch_forward: "Forward") -> Any: ...

    def merge_branch(self, hidden_states: Any, branch: Any, forward: "Forward") -> Any: ...


@runtime_checkable
class PublishesRows(Protocol):
    """A bound row publisher. `publish(layout, forward)` returns its per-row facts for a compute
    input in `layout`; every rank of the stage calls it at the same point, so it may run a
    collective over a group whose ranks all run the stage. Optional attributes:
    `fused_consumer_only` (FFN: leave the output sum to the next input only when a fusion
    provider accepts the batch) and `describe(layout) -> str` (a line for `layer-boundary plan`)."""

    def publish(self, layout: "RowLayout", forward: "Forward") -> Any: ...
