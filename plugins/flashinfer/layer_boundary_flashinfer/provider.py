"""`FlashInferFusion`: consumer candidates that complete an owed sum together with the add + norm.

One provider per stage (the registry's factory builds it from the stage description). Its
candidates are inert until `prepare_flashinfer_fusion` binds them to an agreed workspace; then

- `AllReduceAddNorm` takes an `UnreducedOutput` (attention's declared sum at the FFN input, an
  FFN's deferred sum at the next attention input) and runs all-reduce + residual add + RMSNorm
  in one FlashInfer kernel (`kARResidualRMSNorm`);
- `FinalizeAddNorm` takes a `MoeFinalizeHandoff` (a MoE that left its weighted combine to the
  next input) and runs top-k combine + shared expert + all-reduce + add + RMSNorm in one kernel
  (`kMoEFinalizeARResidualRMSNorm`) up to 128 tokens; above that (where the one-shot-only
  finalize kernel is not tuned) it combines in torch and runs the fused all-reduce + add + norm;
- `AllReduceThenLocalNorms` takes an `UnreducedOutput` where the fused patterns do not apply
  (an output norm owed before the add: post-norm and sandwich layers; a LayerNorm or identity
  read): FlashInfer's plain all-reduce (`kAllReduce`), then the stage's local completion
  (`Stage.read_complete`: the post-norm, add and read norm, as local kernels).

A candidate declines (None, before touching anything) on facts every rank of the group shares:
not bound, a token count outside (0, limit], another dtype or width, another device type, a sum
over other ranks. Inputs that are not contiguous or not 16-byte aligned are copied locally
(this never changes which collective runs). Outputs are new tensors: the old residual is kept.

Inside a compiled region (`torch.compile`) a candidate that accepts is one custom op of
`graph_ops.py` (its declines are the same tests, made while tracing, and become guards); eager
calls launch directly.
"""

from __future__ import annotations

import torch

from layer_boundary import FusedMlpInput, MoeFinalizeHandoff, SumGroup, UnreducedOutput
from layer_boundary.plugin import Fp8Input, graph_key, register_graph_object

from . import graph_ops

__all__ = [
    "FlashInferFusion",
    "FlashInferFinalizeFusion",
    "AllReduceAddNorm",
    "AllReduceAddNormFp8",
    "FinalizeAddNorm",
    "AR_NAME",
    "FINALIZE_NAME",
    "FP8_NAME",
    "AllReduceThenLocalNorms",
    "PLAIN_NAME",
]

AR_NAME = "flashinfer.ar_add_rmsnorm"
FINALIZE_NAME = "flashinfer.moe_finalize_ar_add_rmsnorm"
FP8_NAME = "flashinfer.ar_add_rmsnorm_fp8"
PLAIN_NAME = "flashinfer.all_reduce_then_local_norms"

_Tensor = torch.Tensor


def _aligned(t: _Tensor) -> _Tensor:
    """`t`, or a contiguous 16-byte-aligned copy (the kernels load 16-byte vectors)."""
    if t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _Bound:
    """What a candidate needs at run time, set by `bind` (None fields: not bound)."""

    __slots__ = ("launch", "limit", "dtype", "hidden", "group", "ranks", "cuda", "_graph_key", "__weakref__")

    def __init__(self):
        self.launch = None
        self.limit = 0
        self.dtype = None
        self.hidden = 0
        self.group = None
        self.ranks = ()
        self.cuda = True
        self._graph_key = None

    def bind(self, launch, *, limit: int, dtype, hidden: int, group, cuda: bool = True) -> None:
        self.limit, self.dtype, self.hidden, self.cuda = int(limit), dtype, int(hidden), bool(cuda)
        self.group, self.ranks = group, tuple(group.ranks)
        self.launch = launch
        # what this candidate's op finds it by inside a compiled region (graph_ops.py)
        register_graph_object(self, f"flashinfer.{type(self).__name__}@{getattr(group, 'name', 'group')}{list(self.ranks)}")

    def unbind(self) -> None:
        self.launch = None

    @property
    def bound(self) -> bool:
        return self.launch is not None

    def _same_group(self, group) -> bool:
        return group is self.group or tuple(group.ranks) == self.ranks


class AllReduceAddNorm(_Bound):
    """Candidate for an `UnreducedOutput`: one kernel for all-reduce + add + RMSNorm."""

    __slots__ = ()

    def __call__(self, owed, residual, forward=None):
        launch = self.launch
        if launch is None or type(owed) is not UnreducedOutput:
            return None
        partial = owed.partial
        tokens = partial.shape[0]
        if not 0 < tokens <= self.limit or not isinstance(residual, _Tensor):
            return None
        dtype = self.dtype
        if partial.dtype is not dtype or residual.dtype is not dtype or partial.shape != residual.shape:
            return None
        if partial.dim() != 2 or partial.shape[1] != self.hidden:
            return None
        if partial.is_cuda is not self.cuda or residual.is_cuda is not self.cuda or not self._same_group(owed.group):
            return None
        if torch.compiler.is_compiling():
            return self._graph_call(partial, residual)
        return launch(_aligned(partial), _aligned(residual), tokens)

    def _graph_call(self, partial, residual):
        return graph_ops.ALL_REDUCE_ADD_RMSNORM(partial, residual, graph_key(self))


class FinalizeAddNorm(_Bound):
    """Candidate for a `MoeFinalizeHandoff`: one kernel for combine + all-reduce + add + RMSNorm
    (up to the finalize kernel's token limit), else a torch combine and the fused rest."""

    __slots__ = ("all_reduce", "max_tokens", "max_top_k")

    def __init__(self, all_reduce: AllReduceAddNorm):
        super().__init__()
        self.all_reduce = all_reduce
        self.max_tokens = self.max_top_k = 0

    def bind(self, launch, **facts) -> None:
        super().bind(launch, **facts)
        #: where the one finalize kernel runs (above: a torch combine and the fused all-reduce)
        self.max_tokens, self.max_top_k = int(launch.max_tokens), int(launch.max_top_k)

    def __call__(self, owed, residual, forward=None):
        launch = self.launch
        if launch is None or type(owed) is not MoeFinalizeHandoff:
            return None
        rows = owed.expert_rows
        if not isinstance(rows, _Tensor) or rows.dim() != 3 or not isinstance(residual, _Tensor):
            return None
        tokens, top_k, hidden = rows.shape
        if not 0 < tokens <= self.limit or hidden != self.hidden:
            return None
        dtype = self.dtype
        if rows.dtype is not dtype or residual.dtype is not dtype or residual.shape != (tokens, hidden):
            return None
        weights, shared = owed.weights, owed.shared
        if not isinstance(weights, _Tensor) or weights.shape != (tokens, top_k) or not weights.is_floating_point():
            return None
        if shared is not None and (not isinstance(shared, _Tensor) or shared.dtype is not dtype or shared.shape != residual.shape):
            return None
        cuda = self.cuda
        if rows.is_cuda is not cuda or residual.is_cuda is not cuda or weights.is_cuda is not cuda:
            return None
        if (shared is not None and shared.is_cuda is not cuda) or not self._same_group(owed.group):
            return None
        compiling = torch.compiler.is_compiling()
        if tokens <= self.max_tokens and top_k <= self.max_top_k:
            scales = weights if weights.dtype is dtype else weights.to(dtype)  # the kernel reads scales as the data dtype
            if compiling:
                return graph_ops.FINALIZE_ALL_REDUCE_ADD_RMSNORM(rows, scales, shared, residual, graph_key(self))
            return launch(_aligned(rows), _aligned(scales), None if shared is None else _aligned(shared), _aligned(residual))
        fused = self.all_reduce.launch
        if fused is None:  # pragma: no cover - both are bound and unbound together
            return None
        if compiling:
            return self.all_reduce._graph_call(owed.finalize_local(), residual)
        return fused(_aligned(owed.finalize_local()), _aligned(residual), tokens)


class AllReduceThenLocalNorms(_Bound):
    """Candidate for an `UnreducedOutput` the fused patterns cannot complete (an output norm owed
    before the add, a LayerNorm or identity read): FlashInfer's plain all-reduce kernel, then the
    stage's local completion (`local(total, residual)`: `Stage.read_complete`, set by the
    provider). The same declines as `AllReduceAddNorm`; inside a compiled region it declines (the
    core's completion then runs, its all-reduce on the group), on every rank alike."""

    __slots__ = ("local",)

    def __init__(self):
        super().__init__()
        self.local = None

    def __call__(self, owed, residual, forward=None):
        launch, local = self.launch, self.local
        if launch is None or local is None or type(owed) is not UnreducedOutput or torch.compiler.is_compiling():
            return None
        partial = owed.partial
        tokens = partial.shape[0]
        if not 0 < tokens <= self.limit or not isinstance(residual, _Tensor):
            return None
        dtype = self.dtype
        if partial.dtype is not dtype or residual.dtype is not dtype or partial.shape != residual.shape:
            return None
        if partial.dim() != 2 or partial.shape[1] != self.hidden:
            return None
        if partial.is_cuda is not self.cuda or residual.is_cuda is not self.cuda or not self._same_group(owed.group):
            return None
        return local(launch(_aligned(partial)), residual)


class AllReduceAddNormFp8(AllReduceAddNorm):
    """Candidate for an `UnreducedOutput` at an FP8-quantizing read: all-reduce + add + RMSNorm +
    E4M3 quantization in one kernel (`fmt` "fp8_static": the read's fixed scale; "fp8_dynamic": one
    scale per token). Returns `(Fp8Input, new_residual)`; the same declines as the plain candidate."""

    __slots__ = ("per_token",)

    def __init__(self):
        super().__init__()
        self.per_token = False

    def bind(self, launch, **facts) -> None:
        super().bind(launch, **facts)
        self.per_token = bool(getattr(launch, "per_token", False))

    def _graph_call(self, partial, residual):
        data, scale, new_residual = graph_ops.ALL_REDUCE_ADD_RMSNORM_FP8(partial, residual, graph_key(self), self.per_token)
        return Fp8Input(data, scale, self.dtype), new_residual


class Fp8HandoffAddNorm(_Bound):
    """Candidate for a `MoeFinalizeHandoff` at an FP8-quantizing read: the top-k combine in torch,
    then the fused all-reduce + add + RMSNorm + quantization (the finalize kernel has no FP8 path
    bound here)."""

    __slots__ = ("fused",)

    def __init__(self, fused: AllReduceAddNormFp8):
        super().__init__()
        self.fused = fused

    def __call__(self, owed, residual, forward=None):
        fused = self.fused
        if fused.launch is None or type(owed) is not MoeFinalizeHandoff or not isinstance(residual, _Tensor):
            return None
        rows = owed.expert_rows
        if not isinstance(rows, _Tensor) or rows.dim() != 3 or rows.shape[0] != residual.shape[0]:
            return None
        tokens = rows.shape[0]
        if not 0 < tokens <= fused.limit or rows.shape[2] != fused.hidden or rows.dtype is not fused.dtype:
            return None
        if residual.dtype is not fused.dtype or residual.shape != (tokens, fused.hidden) or rows.is_cuda is not fused.cuda:
            return None
        if residual.is_cuda is not fused.cuda or not fused._same_group(owed.group):
            return None
        if torch.compiler.is_compiling():
            return fused._graph_call(owed.finalize_local(), residual)
        return fused.launch(_aligned(owed.finalize_local()), _aligned(residual), tokens)

    def bind(self, *args, **kwargs) -> None:  # pragma: no cover - bound through `fused`
        raise TypeError("Fp8HandoffAddNorm follows its fused candidate; bind that one")

    def unbind(self) -> None:
        self.fused.unbind()


class _DeferralLimit:
    """How many tokens an FFN may leave its sum to the next input for (0: none); bound to the
    output group's workspace, so a rebuild or a release turns it off with the candidates."""

    __slots__ = ("limit", "__weakref__")

    def __init__(self):
        self.limit = 0

    def unbind(self) -> None:
        self.limit = 0


class FlashInferFusion:
    """Fusion provider of one stage's input. Inert until `prepare_flashinfer_fusion` binds it.

    On an FFN whose sum may leave it only into a fused consumer (a LoRA FFN: its row publisher
    says `fused_consumer_only`), `can_defer_all_reduce` accepts the batches the next input's
    fused all-reduce + add + norm takes (prepared: 0 < tokens <= the output workspace's limit),
    so the fusion at the next input is not lost."""

    def __init__(self, description):
        self.description = description
        self.plan = None
        self.defer_sum = _DeferralLimit()
        self.all_reduce = AllReduceAddNorm()
        self.finalize = FinalizeAddNorm(self.all_reduce)
        self.fp8 = AllReduceAddNormFp8()
        self.fp8_handoff = Fp8HandoffAddNorm(self.fp8)
        self.plain = AllReduceThenLocalNorms()
        #: the input candidates exist only where the stage's input is eligible (set by the factory)
        self.offers_input = True
        #: the plain all-reduce candidate, where the fused patterns do not apply (set by the factory)
        self.offers_plain = False

    @property
    def read_format(self) -> str:
        return self.description.read_format or "plain"

    @property
    def takes_handoff(self) -> bool:
        """The input may receive a MoE finalize handoff (it follows a MoE FFN)."""
        return self.offers_input and self.description.incoming_sum is SumGroup.MOE_OUTPUT

    def attention_input(self, plan):
        self.plan = plan
        if self.offers_plain:  # the stage's local norms after FlashInfer's plain all-reduce
            from .eligibility import PLAIN_NORM_KINDS, PLAIN_POST_NORM_KINDS

            self.plain.local = plan.read_complete
            post = PLAIN_POST_NORM_KINDS if self.description.post_norm_kind is not None else ()
            return (FusedMlpInput(run=self.plain, name=PLAIN_NAME, preserves_residual=True, norm_kinds=PLAIN_NORM_KINDS,
                                  post_norm_kinds=post),)
        if not self.offers_input:
            return ()
        fmt = self.read_format
        if fmt != "plain":  # a quantizing read: the kernels that end in FP8
            items = [FusedMlpInput(run=self.fp8, name=FP8_NAME, preserves_residual=True, output_format=fmt)]
            if self.takes_handoff:
                items.insert(0, FusedMlpInput(run=self.fp8_handoff, handoff=True, name=FP8_NAME,
                                              preserves_residual=True, output_format=fmt))
            return tuple(items)
        items = []
        if self.takes_handoff:
            items.append(FusedMlpInput(run=self.finalize, handoff=True, name=FINALIZE_NAME, preserves_residual=True))
        items.append(FusedMlpInput(run=self.all_reduce, name=AR_NAME, preserves_residual=True))
        return tuple(items)

    ffn_input = attention_input

    def can_defer_all_reduce(self, plan, forward) -> bool:
        return 0 < forward.num_tokens <= self.defer_sum.limit

    @property
    def bound(self) -> bool:
        return self.all_reduce.bound or self.fp8.bound or self.plain.bound

    def __repr__(self) -> str:
        state = "bound" if self.bound else "not prepared"
        return f"FlashInferFusion({self.description.label}, {state})"


class FlashInferFinalizeFusion(FlashInferFusion):
    """The provider of a MoE FFN stage: also lets its MoE hand the finalize to the next input
    (`can_defer_finalize`) once the output group's workspace is agreed."""

    def __init__(self, description):
        super().__init__(description)
        self.finalize_limit = 0  #: 0: deferral off (not prepared, or no workspace for the output sum)

    def enable_finalize(self, limit: int) -> None:
        self.finalize_limit = int(limit)

    def disable_finalize(self) -> None:
        self.finalize_limit = 0

    #: a workspace rebuild or release turns the deferral off with the candidates
    unbind = disable_finalize

    def can_defer_finalize(self, plan, forward) -> bool:
        return 0 < forward.num_tokens <= self.finalize_limit
