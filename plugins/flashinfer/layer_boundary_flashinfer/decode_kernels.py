"""The flashinfer plugin's attention kernels for the reference models' static-cache path: the
`RopeKernel` "flashinfer.rope" and the `DecodeAttentionKernel` "flashinfer.decode_attention".

Rope: FlashInfer 0.7.2's `apply_rope_with_cos_sin_cache(positions, query, key, head_size,
cos_sin_cache, is_neox=True)`, out of place (new query and key; the inputs stay as they are),
over a float32 table [max_positions, head_dim] built once here (the core's `rope_cos_sin_table`:
cos of `position * inv_freq` in the first half, sin in the second).

Decode attention: `BatchDecodeWithPagedKVCacheWrapper` (HND layout; its decode kernel without
tensor cores for short caches, with them and without the split for long ones:
`uses_tensor_cores`, `splits_kv`) over the core's `StaticKVCache` as it is: a slot's [kv_heads,
max_len, head_dim] block is one page of `max_len` tokens, so the page table is the slot of each
row and the last page's length is the row's position + 1. The plan depends only on the batch
size and the page count (one page per row), not on the lengths, so it is made once per batch
size and cache shape, at the first (eager) call; every call writes the step's lengths (and
slots) into the wrapper's buffers and runs. The tensor-core plan is made in FlashInfer's
CUDA-graph mode over the plan's buffers. The CUDA-core plan is not: in that mode FlashInfer
always splits a row's keys and merges the parts in a second launch, and with one page a row
nothing can be split (its split is by pages), so the merge is a copy. Planned outside that mode,
over our device buffers (which FlashInfer then keeps as they are, `plan_reads_our_buffers`),
it runs one launch a layer and replays in a graph just the same. The first call for a batch size must come before
any CUDA-graph capture (a warm-up, as `CapturedStep` does).

The kernel is step-bound (`DecodeAttentionKernel`): `bind_step` writes the lengths (and slots)
into the plan's buffers once per step, and each layer's `write` is one
`append_paged_kv_cache` launch for its keys and values (int32 positions, cast once per step)
before `attend` runs the planned wrapper: per layer one launch where the core's torch path runs
an `index_put_` each, and no per-layer length update.

Both factories decline without CUDA, for dtypes other than bf16/fp16, a head_dim FlashInfer
has no kernel for, `LAYER_BOUNDARY_FLASHINFER=0`, flashinfer missing, and a first launch that
fails (each runs one now, so a JIT build happens here and not inside a capture). Under
torch.compile each call is one custom op (`layer_boundary_flashinfer::rope`,
`layer_boundary_flashinfer::decode_attention`, and the step-bound `decode_bind`,
`decode_append` (mutating the cache), `decode_attend`) with a fake implementation; the int32
positions `decode_bind` returns are an input of every later op of the step, which orders them
after the buffers it writes.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from layer_boundary.plugin import graph_key, graph_object, register_graph_object, rope_cos_sin_table

from .eligibility import first_launch, model_kernel_reason

__all__ = ["FlashInferRope", "FlashInferDecodeAttention", "rope_factory", "decode_attention_factory", "reason"]

log = logging.getLogger("layer_boundary.flashinfer")

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128, 256)
#: the float workspace FlashInfer's decode splits use (its recommended size)
WORKSPACE_BYTES = 128 * 2**20
#: from how many cached tokens a slot FlashInfer's tensor-core decode kernel runs, for one row
#: and for a batch of `TENSOR_CORE_BATCH` rows or more, and up to how many it runs without
#: splitting a row's keys over blocks (no merge launch). Timed on an H200 (32 query / 8 KV heads,
#: D 128, 8 layers, graph replay, us a step), the CUDA-core kernel as planned here (outside graph
#: mode, no split) / tensor cores without the split:
#:   batch 1:  29.9 / 65.0 at 40 tokens, 60.1 / 65.0 at 128, 40.9 / 64.9 at 256, 98.5 / 78.8 at 512
#:   batch 8:  29.0 / 64.5 at 40, 60.0 / 67.5 at 128, 97.9 / 80.7 at 256
#:   batch 32: 40.1 / 68.8 at 40, 81.7 / 82.3 at 128, 136.9 / 105.0 at 256
#: (the CUDA-core kernel in graph mode, split and merged: 40.2, 46.4 and 67.2 at 40 tokens). Without
#: the split the tensor-core kernel is faster than with it at every batch (1, 8, 32) and length
#: (40 to 8200) timed, by 2-25%; beyond 8200 tokens it keeps the split (not timed). The choice
#: depends on the plan's shape only: the same on every rank.
TENSOR_CORE_MIN_LEN = 512
TENSOR_CORE_BATCH, TENSOR_CORE_BATCH_MIN_LEN = 8, 256
TENSOR_CORE_NO_SPLIT_MAX_LEN = 8200


def uses_tensor_cores(batch: int, page_size: int) -> bool:
    """Whether a plan for `batch` rows over slots of `page_size` tokens takes the tensor-core kernel."""
    return page_size >= TENSOR_CORE_MIN_LEN or (batch >= TENSOR_CORE_BATCH and page_size >= TENSOR_CORE_BATCH_MIN_LEN)


def splits_kv(batch: int, page_size: int) -> bool:
    """Whether that plan splits a row's keys over blocks (and merges them in a second launch):
    only the tensor-core kernel over a cache longer than `TENSOR_CORE_NO_SPLIT_MAX_LEN`. The
    CUDA-core kernel splits by pages, and a row is one page."""
    return uses_tensor_cores(batch, page_size) and page_size > TENSOR_CORE_NO_SPLIT_MAX_LEN


def plan_reads_our_buffers(wrapper, indptr, indices, lengths) -> bool:
    """Whether a wrapper planned outside CUDA-graph mode runs over these very tensors (FlashInfer
    0.7.2 keeps a device tensor given to `plan` as it is), so that writing the step's lengths and
    slots into them reaches the kernel. Checked after each such plan; where it fails the plugin
    plans in CUDA-graph mode instead (correct, one merge launch more a layer)."""
    kept = [getattr(wrapper, name, None) for name in ("_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf")]
    return all(isinstance(t, torch.Tensor) and t.data_ptr() == ours.data_ptr() for t, ours in zip(kept, (indptr, indices, lengths)))


def reason(request) -> Optional[str]:
    """Why the kernels are not asked for `request` (None: they are tried)."""
    return model_kernel_reason(request, DTYPES, None if request.head_dim in HEAD_DIMS else f"head_dim {request.head_dim}")


def _rope(q, k, positions, table):
    import flashinfer

    T, D = q.shape[0], q.shape[-1]
    q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions, q.reshape(T, -1), k.reshape(T, -1), D, table, is_neox=True)
    return q_out.view(q.shape), k_out.view(k.shape)


class FlashInferRope:
    """`(q [T, heads, D], k [T, kv_heads, D], positions [T]) -> (q, k)` rotated, new tensors."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, q, k, positions):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.rope(q, k, positions, self.table)
        return _rope(q.contiguous(), k.contiguous(), positions, self.table)

    def __repr__(self) -> str:
        return f"FlashInferRope(max_positions={self.table.shape[0]}, head_dim={self.table.shape[1]})"


def rope_factory(request) -> Optional[FlashInferRope]:
    """The `RopeKernel` factory: a table for `request.max_positions` and one trial launch."""

    def launch():
        kernel = FlashInferRope(rope_cos_sin_table(request.head_dim, request.theta, request.max_positions, request.device))
        q = torch.zeros(1, request.heads, request.head_dim, dtype=request.dtype, device=request.device)
        k = torch.zeros(1, request.kv_heads, request.head_dim, dtype=request.dtype, device=request.device)
        kernel(q, k, torch.zeros(1, dtype=torch.long, device=request.device))
        return kernel

    return first_launch("flashinfer.rope", request.dtype, request.device, launch, declined=reason(request))


class _Planned:
    """One planned wrapper: a batch size over a cache of `pages` slots of `page_size` tokens."""

    def __init__(self, request, batch: int, pages: int, page_size: int, workspace: torch.Tensor):
        import flashinfer

        device = workspace.device
        self.indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.arange(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, dtype=torch.int32, device=device)  # row i is request i (one page each)
        self.lengths = torch.full((batch,), page_size, dtype=torch.int32, device=device)
        tensor_cores = uses_tensor_cores(batch, page_size)
        geometry = (request.heads, request.kv_heads, request.head_dim, page_size)
        options = dict(q_data_type=request.dtype, kv_data_type=request.dtype, sm_scale=request.scaling)
        self.graph_mode = tensor_cores
        if not tensor_cores:  # one launch a layer: no split, no merge (the module docstring says why)
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND", use_tensor_cores=False)
            self.wrapper.plan(self.indptr, self.indices, self.lengths, *geometry, **options)
            if not plan_reads_our_buffers(self.wrapper, self.indptr, self.indices, self.lengths):
                log.warning("flashinfer.decode_attention: this FlashInfer copies the plan's buffers outside CUDA-graph mode; "
                            "planning in that mode (one merge launch more a layer)")
                self.graph_mode = True
        if self.graph_mode:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.lengths,
            )
            self.wrapper.plan(
                torch.arange(batch + 1, dtype=torch.int32), torch.arange(batch, dtype=torch.int32),
                torch.full((batch,), page_size, dtype=torch.int32), *geometry,
                disable_split_kv=not splits_kv(batch, page_size), **options,
            )

    def bind(self, slots, positions) -> torch.Tensor:
        """Write the step's lengths (and slots) into the plan's buffers; the int32 positions."""
        torch.add(positions, 1, out=self.lengths)
        if slots is not None:  # a wrapper planned for given slots (rows-are-slots ones keep 0..batch-1)
            self.indices.copy_(slots)
        return positions.to(torch.int32)

    def append(self, k, v, k_cache, v_cache, positions32) -> None:
        """Row i's keys and values at `positions32[i]` of its page (its slot): one launch."""
        import flashinfer

        flashinfer.append_paged_kv_cache(
            k, v, self.rows, positions32, (k_cache, v_cache), self.indices, self.indptr, self.lengths, kv_layout="HND"
        )

    def run(self, q, k_cache, v_cache, slots, positions):
        self.bind(slots, positions)
        return self.wrapper.run(q, (k_cache, v_cache))


class FlashInferDecodeAttention:
    """`(q [T, heads, D], k_cache, v_cache [slots, kv_heads, max_len, D], slots [T] or None,
    positions [T]) -> [T, heads, D]`: row i attends to positions 0..positions[i] of its slot."""

    def __init__(self, request):
        self.request = request
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=request.device)
        self.planned: dict = {}
        register_graph_object(self, "flashinfer.decode_attention")

    def _planned(self, batch: int, k_cache, slots_given: bool) -> _Planned:
        key = (batch, k_cache.shape[0], k_cache.shape[2], slots_given)
        planned = self.planned.get(key)
        if planned is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"flashinfer.decode_attention has no plan for batch {batch} over a cache of {key[1]} x {key[2]}: "
                    "run one eager step of this batch size before capturing a CUDA graph (CapturedStep warms up)"
                )
            planned = self.planned[key] = _Planned(self.request, batch, key[1], key[2], self.workspace)
        return planned

    def run(self, q, k_cache, v_cache, slots, positions):
        return self._planned(q.shape[0], k_cache, slots is not None).run(q.contiguous(), k_cache, v_cache, slots, positions)

    def __call__(self, q, k_cache, v_cache, slots, positions):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.decode_attention(q, k_cache, v_cache, slots, positions, graph_key(self))
        return self.run(q, k_cache, v_cache, slots, positions)

    # step-bound: the step's lengths once, each layer's keys and values in one launch -------------

    def bind(self, k_cache, slots, positions) -> torch.Tensor:
        return self._planned(positions.shape[0], k_cache, slots is not None).bind(slots, positions)

    def append(self, positions32, slots_given: bool, k, v, k_cache, v_cache) -> None:
        self._planned(k.shape[0], k_cache, slots_given).append(k, v, k_cache, v_cache, positions32)

    def attend_planned(self, slots_given: bool, q, k_cache, v_cache) -> torch.Tensor:
        return self._planned(q.shape[0], k_cache, slots_given).wrapper.run(q.contiguous(), (k_cache, v_cache))

    def bind_step(self, k_cache, slots, positions) -> tuple:
        """(int32 positions, slots): the state every layer's `write` and `attend` take."""
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.decode_bind(k_cache, slots, positions, graph_key(self)), slots
        return self.bind(k_cache, slots, positions), slots

    def write(self, state, k, v, k_cache, v_cache) -> None:
        positions32, slots = state
        if torch.compiler.is_compiling():
            torch.ops.layer_boundary_flashinfer.decode_append(k, v, k_cache, v_cache, positions32, slots is not None, graph_key(self))
            return
        self.append(positions32, slots is not None, k, v, k_cache, v_cache)

    def attend(self, state, q, k_cache, v_cache) -> torch.Tensor:
        positions32, slots = state
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.decode_attend(q, k_cache, v_cache, positions32, slots is not None, graph_key(self))
        return self.attend_planned(slots is not None, q, k_cache, v_cache)

    def __repr__(self) -> str:
        r = self.request
        return f"FlashInferDecodeAttention(heads={r.heads}, kv_heads={r.kv_heads}, head_dim={r.head_dim}, {r.dtype})"


def decode_attention_factory(request) -> Optional[FlashInferDecodeAttention]:
    """The `DecodeAttentionKernel` factory: one trial step over a one-slot cache."""
    if reason(request) is not None:
        return None
    if request.heads % request.kv_heads:
        return None

    def launch():
        kernel = FlashInferDecodeAttention(request)
        cache = torch.zeros(1, request.kv_heads, 16, request.head_dim, dtype=request.dtype, device=request.device)
        q = torch.zeros(1, request.heads, request.head_dim, dtype=request.dtype, device=request.device)
        positions = torch.zeros(1, dtype=torch.long, device=request.device)
        kernel(q, cache, cache, None, positions)
        state = kernel.bind_step(cache, None, positions)  # builds the append kernel too (not inside a capture)
        k = torch.zeros(1, request.kv_heads, request.head_dim, dtype=request.dtype, device=request.device)
        kernel.write(state, k, k, cache, cache.clone())
        return kernel

    kernel = first_launch("flashinfer.decode_attention", request.dtype, request.device, launch)
    if kernel is not None:
        kernel.planned.clear()  # the trial's plans: a model's batch sizes are planned at their first call
    return kernel


# the custom ops torch.compile traces --------------------------------------------------------------


@torch.library.custom_op("layer_boundary_flashinfer::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q.contiguous(), k.contiguous(), positions, table)


@_rope_op.register_fake
def _(q, k, positions, table):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)


@torch.library.custom_op("layer_boundary_flashinfer::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: Optional[torch.Tensor], positions: torch.Tensor, key: str
) -> torch.Tensor:
    return graph_object(key).run(q, k_cache, v_cache, slots, positions)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, slots, positions, key):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("layer_boundary_flashinfer::decode_bind", mutates_args=())
def _decode_bind_op(k_cache: torch.Tensor, slots: Optional[torch.Tensor], positions: torch.Tensor, key: str) -> torch.Tensor:
    return graph_object(key).bind(k_cache, slots, positions)


@_decode_bind_op.register_fake
def _(k_cache, slots, positions, key):
    return torch.empty_like(positions, dtype=torch.int32)


@torch.library.custom_op("layer_boundary_flashinfer::decode_append", mutates_args=("k_cache", "v_cache"))
def _decode_append_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions32: torch.Tensor, slots_given: bool, key: str
) -> None:
    graph_object(key).append(positions32, slots_given, k, v, k_cache, v_cache)


@_decode_append_op.register_fake
def _(k, v, k_cache, v_cache, positions32, slots_given, key):
    return None


@torch.library.custom_op("layer_boundary_flashinfer::decode_attend", mutates_args=())
def _decode_attend_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions32: torch.Tensor, slots_given: bool, key: str
) -> torch.Tensor:
    return graph_object(key).attend_planned(slots_given, q, k_cache, v_cache)


@_decode_attend_op.register_fake
def _(q, k_cache, v_cache, positions32, slots_given, key):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
