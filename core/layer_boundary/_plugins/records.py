"""Typed registration records (frozen, keyword-only), one per extension point, and the
provenance wrapper the registry adds.

Every record has a dotted `name` prefixed by its plugin, a `factory` the core calls with the
extension point's typed request (see `_requests`), a `priority` (higher is asked first; ties
by name, never by install order) and a one-line `description`. A factory returns None when it
does not apply; raising means "mine, but broken".
"""

from __future__ import annotations

import importlib
import re
import types
from typing import Any, Callable, Generic, Mapping, Optional, TypeVar

import attrs


_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")


def _valid_name(instance, attribute, value):
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.name must be a dotted lowercase name prefixed by its plugin "
            f"(for example 'flashinfer.ar_add_rmsnorm'), got {value!r}"
        )


def _valid_kind(instance, attribute, value):
    if not isinstance(value, str) or not _KIND.match(value):
        raise ValueError(f"{type(instance).__name__}.kind must be a lowercase word such as 'lora', got {value!r}")


def _callable(instance, attribute, value):
    if not callable(value):
        raise TypeError(f"{type(instance).__name__}.{attribute.name} must be callable, got {value!r}")


@attrs.frozen
class Lazy:
    """`lazy("package.module:attribute")`: a callable that imports the attribute on its first
    call and forwards to it, so a record can name heavy code without importing it while the
    registry is built (listing plugins, a CPU-only machine)."""

    target: str = attrs.field()

    @target.validator
    def _check(self, attribute, value):
        module, sep, name = value.partition(":")
        if not (sep and module and name):
            raise ValueError(f"lazy() takes 'package.module:attribute', got {value!r}")

    def resolve(self) -> Any:
        module, _, name = self.target.partition(":")
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        return found

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


def lazy(target: str) -> Lazy:
    """A callable standing for `target` ("package.module:attribute"), imported when first called."""
    return Lazy(target)


def _frozen_mapping(value) -> Mapping:
    return types.MappingProxyType(dict(value or {}))


class Priority:
    """Priority bands. Higher runs first; ties are broken by name, never by install order."""

    BUILTIN = -1000  #: the core's unfused defaults, always applicable, always last
    REFERENCE = 0  #: pure-torch implementations
    GENERIC = 100
    VENDOR = 200  #: vendor libraries (FlashInfer)
    ARCH_SPECIFIC = 300  #: kernels for one GPU family (CuTe DSL on Hopper)


@attrs.frozen(kw_only=True)
class _Record:
    name: str = attrs.field(validator=_valid_name)
    factory: Callable[..., Any] = attrs.field(validator=_callable)
    priority: int = 0
    description: str = ""


@attrs.frozen(kw_only=True)
class FusionProvider(_Record):
    """Hook `layer_boundary_fusion_providers`: a backend that completes what a stage's input owes
    together with the add + norm (and may let producers defer work to it).

    `factory(stage: StageDescription)` runs once per stage at construction and returns a
    provider object with any of the capabilities `AttentionInputFusion`, `FfnInputFusion`,
    `DefersFinalize`, `DefersAllReduce`, or None when the stage is outside what it handles.
    It must not import heavy libraries before deciding.

    `contract_preparation`: "module:Class" of how the provider contract suite readies this record
    on a machine without its hardware (a context manager for a rank's pass with a
    `bind(provider, plan)` method, e.g. binding the candidates to reference kernels). The suite
    fails a record that accepts no case, so a record whose candidates need hardware or a
    `prepare` names one.
    """

    contract_preparation: Optional[str] = None


@attrs.frozen(kw_only=True)
class ResidualKind(_Record):
    """Hook `layer_boundary_residual_kinds`: named residual semantics. Model code asks for
    them by `kind` (`residual_kind(kind, **options)`); `factory(**options)` returns a
    `ResidualOps`. The record with the highest priority of a kind wins."""

    kind: str = attrs.field(validator=_valid_kind)


@attrs.frozen(kw_only=True)
class CpPathProvider(_Record):
    """Hook `layer_boundary_cp_paths`: the context-parallel path of a stage.

    `factory(request: CpPathRequest)` returns the stage's `StagePath` for
    `BatchVariant.CONTEXT_PARALLEL` (built from `request.ordinary` with the public path
    builders), None when it does not apply, or raises `NotImplementedError(reason)` for a
    stage it knows it cannot carry (the reason is shown by `layer-boundary plan`)."""


@attrs.frozen(kw_only=True)
class TokenMappingProvider(_Record):
    """Hook `layer_boundary_token_mappings`: `factory(request: TokenMappingRequest)` returns
    the token mapping of a context-parallel batch (a `CpTokenMapping`), for `Forward(cp=...)`."""


@attrs.frozen(kw_only=True)
class OverlapProvider(_Record):
    """Hook `layer_boundary_overlaps`: `factory(request: OverlapRequest)` returns the
    two-batch-overlap scheduler (an `Overlap`) of a batch, or None."""


@attrs.frozen(kw_only=True)
class BranchProvider(_Record):
    """Hook `layer_boundary_branches`: `factory(request: BranchRequest)` returns the transport
    of prepared branches (a `BranchTransport`), or None."""


@attrs.frozen(kw_only=True)
class RowPublisher(_Record):
    """Hook `layer_boundary_row_publishers`: a stage built with `publish_rows=(kind, ...)`
    binds the first publisher of each kind whose `factory(request: RowPublisherRequest)`
    returns an object (`PublishesRows`); after every `prepare()` it says, per row of the
    compute input, what that stage's compute needs to know (LoRA: each row's adapter)."""

    kind: str = attrs.field(validator=_valid_kind)


@attrs.frozen(kw_only=True)
class AddNormKernel(_Record):
    """Hook `layer_boundary_add_norm_kernels`: a local kernel for the plain residual add +
    RMSNorm of one rank's rows (no collective): what a boundary runs when nothing is owed (TP=1,
    or after the sum completed unfused) and what the final norm runs.

    `factory(request: AddNormRequest)` runs once per (norm, device, dtypes) at the first call
    (or at `prepare_model`) and returns `kernel(contribution, residual, weight) -> (normed,
    new_residual)`, or None to decline (another device, dtype, width, a missing library). The
    kernel keeps the reference numerics (`add_rms_norm`: the sum in fp32 rounded once into the
    new residual, the norm reads the unrounded sum), returns new tensors and never writes into
    its inputs (the caller may still hold them: captures, snapshots). The first accepting record
    in (-priority, name) order wins; the norm's own torch `add_forward` runs when none accepts.
    The choice is per rank (it changes no collective). Compile or load in the factory: the kernel
    may then be called inside a CUDA-graph capture and must be traceable by torch.compile
    (a `torch.library.custom_op` with a fake implementation, when compiling).

    `contract_preparation`: "module:callable" returning the factory the contract suite runs on
    a machine without the hardware (the plugin's kernels bound to references); on CUDA the
    suite runs `factory` itself.

    `norm_factory(request: AddNormRequest)`, optional: the same for a norm with no add (Qwen3's
    per-head q/k norms, a first layer's input norm): `kernel(x, weight) -> normed`, new tensor
    out, the norm of x in fp32 times `weight + offset`, rounded once; None declines. A record
    without one declines every plain norm.

    `norm_kinds`: the request kinds the factories implement (default the RMSNorm kinds, "rms"
    and "gemma_rms"; "layer" for LayerNorm, whose kernel takes the bias as a fourth argument);
    a request of another kind is not handed to them.

    `post_norm_factory(request: PostNormRequest)`, optional: the local completion of an output
    that owes its producer's output norm (a post-norm or sandwich layer: OLMo-2, Gemma 2/3) in
    one launch, post-norm + add + the read's norm: `kernel(contribution, residual, post_weight,
    post_bias, weight, bias) -> (normed, new_residual)` (see `PostNormRequest`), or None. Asked
    only when both norm kinds are among `norm_kinds` (the read's may also be "none").
    """

    contract_preparation: Optional[str] = None
    norm_factory: Optional[Callable] = None
    post_norm_factory: Optional[Callable] = None
    #: the `AddNormRequest.norm_kind`s the kernels implement; the core asks the factories only
    #: for these (a LayerNorm, kind "layer", never reaches an RMSNorm kernel)
    norm_kinds: tuple = ("rms", "gemma_rms")


@attrs.frozen(kw_only=True)
class RopeKernel(_Record):
    """Hook `layer_boundary_rope_kernels`: a rotary-embedding kernel for the reference attention's
    static-cache path (prefill and decode through `StaticKVCache`).

    `factory(request: RopeRequest)` runs once per model at `prepare_model` and returns
    `kernel(q, k, positions) -> (q, k)` (queries [tokens, heads, D], keys [tokens, kv_heads, D],
    int64 positions [tokens]; new tensors, the inputs unwritten), or None to decline (another
    device, dtype, head_dim, a missing library). The first record every rank of the model's TP
    group accepts wins (the core agrees with one all_reduce), so ranks never differ; the core's
    torch rotation runs when none does. Build tables and compile in the factory: the kernel may
    be called inside a CUDA-graph capture and must be traceable by torch.compile (a
    `torch.library.custom_op` with a fake implementation)."""


@attrs.frozen(kw_only=True)
class QKNormRopeKernel(_Record):
    """Hook `layer_boundary_qk_norm_rope_kernels`: the per-head RMSNorm of queries and keys (Qwen3's
    q_norm and k_norm) and the rotary embedding in one kernel, for the reference attention's
    static-cache path, where the core runs three launches (two norms, then the rope).

    `factory(request: QKNormRopeRequest)` runs once per model at `prepare_model` and returns
    `kernel(q, k, positions, q_weight, k_weight) -> (q, k)`: queries [tokens, heads, D] and keys
    [tokens, kv_heads, D], which may be strided views (rows strided by the fused q/k/v
    projection's width, the last dim contiguous); int64 positions [tokens]; the norms' weights
    [D]. It returns new contiguous tensors of the same shapes (the inputs unwritten), or the
    factory returns None to decline (another device, dtype, head_dim, a missing library). Asked
    only for attentions with q/k norms, together with the `RopeKernel` and
    `DecodeAttentionKernel` records and chosen like them (rank-agreed in the same all_reduce,
    torch last). Where it is chosen it replaces both norms and the rope kernel. Build tables and
    compile in the factory: the kernel may be called inside a CUDA-graph capture and must be
    traceable by torch.compile (a `torch.library.custom_op` with a fake implementation)."""


@attrs.frozen(kw_only=True)
class DecodeAttentionKernel(_Record):
    """Hook `layer_boundary_decode_attention_kernels`: the attention of one decode token per row
    against the reference models' static KV cache.

    `factory(request: DecodeAttentionRequest)` runs once per model at `prepare_model` and returns
    `kernel(q, k_cache, v_cache, slots, positions) -> out`: q [tokens, heads, D]; this layer's
    cache [cache slots, kv_heads, max_len, D] (the step's keys and values already written); slots
    [tokens] int64, or None when row i is cache slot i; positions [tokens] int64 (row i attends
    to 0..positions[i]); out a new [tokens, heads, D]. None declines. Chosen like `RopeKernel`
    (rank-agreed, torch last). Planning that needs the host (batch size, cache shape) happens at
    the first call of a shape, which comes before any capture (a warm-up step); afterwards a call
    is capturable and traceable (a custom op).

    A kernel that also writes the step's keys and values (one launch for both, where the core
    runs an `index_put_` each) is *step-bound*: it has `bind_step(k_cache, slots, positions) ->
    state` (the layer-0 cache, to plan by its shape), called once per step for every layer,
    `write(state, k, v, k_cache, v_cache)` (k, v [tokens, kv_heads, D], last dim contiguous;
    writes the cache in place) and `attend(state, q, k_cache, v_cache) -> out`. `state` is a
    tensor or tuple of tensors (it flows through compiled graphs), and the per-step work that
    the layers share (lengths, page tables) belongs in `bind_step`."""


@attrs.frozen(kw_only=True)
class GatedActivationKernel(_Record):
    """Hook `layer_boundary_gated_activation_kernels`: the activation-and-multiply of the reference
    models' gated MLP (`TPGatedMLP`: `down(act(gate) * up)`), one launch where torch runs two.

    `factory(request: GatedActivationRequest)` runs once per model and MLP width at
    `prepare_model` and returns `kernel(gate_up) -> out`: gate_up [tokens, 2 * d], the gate in
    the first d columns and the up projection in the last d (the fused projection's output,
    contiguous); out a new [tokens, d] of the same dtype, `act(gate) * up` with `act` the
    request's activation. None declines (another device, dtype, activation, a missing library).
    Chosen like `RopeKernel` (rank-agreed, torch last). The kernel may be called inside a CUDA-graph
    capture and must be traceable by torch.compile (a `torch.library.custom_op` with a fake
    implementation)."""


@attrs.frozen(kw_only=True)
class Benchmark(_Record):
    """Hook `layer_boundary_benchmarks`: `layer-boundary bench COMMAND [options]` calls
    `factory(options)` (the option strings); a benchmark prints a table and writes its results
    (JSON + PNG under benchmarks/results/). Import the benchmark's code inside the factory."""

    command: str = attrs.field(validator=_valid_kind)

    @classmethod
    def of_module(cls, module: str, **fields) -> "Benchmark":
        """The benchmark whose code is `module`'s `main(argv)`, imported only when it runs."""
        return cls(factory=lazy(f"{module}:main"), **fields)


#: the run options a `ModelFamily` may support (`layer-boundary run` refuses the others): LoRA
#: adapters on its projections, FP8 reads at its stage inputs, two-batch overlap
FAMILY_OPTIONS = frozenset({"lora", "fp8", "tbo"})


def _valid_options(instance, attribute, value):
    unknown = sorted(set(value) - FAMILY_OPTIONS)
    if unknown:
        raise ValueError(f"ModelFamily.options: unknown option(s) {unknown}; the options are {sorted(FAMILY_OPTIONS)}")


@attrs.frozen(kw_only=True)
class ModelFamily(_Record):
    """Hook `layer_boundary_model_families`: a model family that `layer-boundary run`, `plan`
    and `bench decode` build, load, run and check, found by its `model` name (`--model NAME`).

    `factory(request: BuildRequest)` builds this rank's sharded model (a `torch.nn.Module`
    called as `model(input_ids, forward, step, cache)` with a `StepLayout` and the cache of
    `model.new_cache()`, returning logits for the rank's rows, or None on an earlier pipeline
    stage), or returns None / raises `NotImplementedError(reason)` for a request it cannot build.
    `parse(config: dict)` turns a Hugging Face config dict into the family's config (with `.hf`,
    `.num_layers`, `.vocab_size`, `.hidden_size` and `.check_topology(topology)`, raising
    `ConfigError` naming the field it cannot use: `ConfigFields` reads each field with its type
    checked). `load_weights(model, source: TensorSource)` loads this rank's shard from tensors
    with Hugging Face names (a factory returning `mark_unloaded(model, hint)` and a loader
    wrapped in `@loads_weights` refuse a forward before the load); `random_weights(config, dtype,
    seed)` draws a full state dict with those names. `reference(request: ReferenceRequest)`
    returns the `HfReference` the run is checked against; None builds `model_type`'s Hugging
    Face causal LM from the config and loads the state dict strictly. `preset()` returns the
    embedded tiny config (no download), `realistic()` a real-width one for `bench decode` (whose
    models also need `new_static_cache(slots, max_len)`, see docs/models.md); `options` the
    run options the family supports (`FAMILY_OPTIONS`); `requires` the plugin features it
    needs as (extension point, name), checked before any rank starts; `tolerances` per-dtype
    relative tolerances looser than the default (and "fp8"), for a reference not reproducible
    beyond them; `describe(model)` the lines `plan` shows for the model as a whole (the kernels
    the family's own modules choose), by label.
    """

    model: str = attrs.field(validator=_valid_kind)
    model_type: str
    parse: Callable[[dict], Any] = attrs.field(validator=_callable)
    load_weights: Callable[..., None] = attrs.field(validator=_callable)
    random_weights: Callable[..., dict] = attrs.field(validator=_callable)
    preset: Callable[[], dict] = attrs.field(validator=_callable)
    architectures: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    reference: Optional[Callable] = None
    realistic: Optional[Callable[[], dict]] = None
    options: frozenset = attrs.field(default=frozenset(), converter=frozenset, validator=_valid_options)
    requires: tuple = attrs.field(default=(), converter=tuple)
    tolerances: Mapping = attrs.field(factory=dict, converter=_frozen_mapping)
    describe: Optional[Callable[[Any], Mapping]] = None


T = TypeVar("T")


@attrs.frozen
class Registered(Generic[T]):
    """A record with where it came from."""

    record: T
    plugin: str
    distribution: Optional[str]
    version: Optional[str]
    #: registered by the core's built-in plugin: asked after every other record
    builtin: bool = False

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def priority(self) -> int:
        return self.record.priority


def selection_key(item: Registered) -> tuple[bool, int, str]:
    """The built-in plugin's records last, the others by (-priority, name): a total order,
    since names are unique."""
    return (item.builtin, -item.record.priority, item.record.name)
