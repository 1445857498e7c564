"""Per-head RMSNorm of queries and keys, then the rotary embedding, in one CuTe DSL kernel
(imports cutlass: load lazily).

qwen3-style attention normalizes every head of q and k over head_dim, each with its own
weight, and then rotates them: three launches unfused (q norm, k norm, rope). Here one group of
head_dim / 8 threads holds one head row (8 elements, one 16-byte vector a thread): the sum of
squares is a butterfly over the group, the normalized value times the weight is rounded once
to the model dtype (as FlashInfer's rmsnorm, the unfused path with the flashinfer plugin, hands
it to the rope; the core's torch RMSNorm rounds before the weight multiply), and the half-split ("neox") rotation takes its
partner element from the thread head_dim / 16 lanes away (one shuffle). cos and sin come from a
float32 table [max_positions, head_dim] (cos in the first half, sin in the second), rounded
once at the end, as FlashInfer's rope computes.

Queries and keys are read where the fused q/k/v projection left them (rows strided by its
width) and written as new contiguous [tokens, heads, head_dim] tensors.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .dsl_rows import cutlass_dtype, gmem_vector, launch_indices, load_scalar, vector_atom

__all__ = ["QKNormRopeKernel"]

#: elements a thread holds: one 16-byte vector of a 2-byte dtype
ELEMS = 8


class QKNormRopeKernel:
    """Arguments: addresses of q, k (rows `q_stride` / `k_stride` elements apart, heads back to
    back), q_weight, k_weight [head_dim], the float32 table, int64 positions [tokens], q_out,
    k_out (contiguous); `tokens`; eps; `grid` CTAs (grid-stride over blocks of head rows)."""

    def __init__(self, variant):
        self.dtype = cutlass_dtype(variant.dtype)
        self.ebytes = 2
        self.head_dim = variant.head_dim
        self.heads = variant.heads
        self.kv_heads = variant.kv_heads
        self.per_token = variant.heads + variant.kv_heads
        self.lanes = variant.head_dim // ELEMS  # threads a head row
        self.rows_per_cta = variant.cta_threads // self.lanes
        self.cta_threads = variant.cta_threads
        self.pdl = bool(variant.pdl)
        # the butterfly's lane distances over a head-row group: lanes / 2, ..., 1
        self.offsets = [self.lanes >> (i + 1) for i in range(self.lanes.bit_length() - 1)]

    @cute.jit
    def __call__(self, q: Int64, k: Int64, q_weight: Int64, k_weight: Int64, table: Int64, positions: Int64, q_out: Int64, k_out: Int64,
                 tokens: Int32, q_stride: Int32, k_stride: Int32, eps: Float32, grid: Int32, stream: cuda.CUstream):
        self.kernel(q, k, q_weight, k_weight, table, positions, q_out, k_out, tokens, q_stride, k_stride, eps).launch(
            grid=[grid, 1, 1], block=[self.cta_threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.jit
    def _load_half(self, addr: Int64):
        """8 elements of the model dtype at `addr` (16-byte aligned), as float32."""
        frag = cute.make_rmem_tensor((ELEMS,), self.dtype)
        cute.copy(vector_atom(self.dtype), gmem_vector(self.dtype, addr, ELEMS), frag)
        return frag.load().to(Float32)

    @cute.jit
    def _load_f32(self, addr: Int64):
        """8 float32 at `addr` (16-byte aligned): two 16-byte loads."""
        atom = vector_atom(Float32)
        frag = cute.make_rmem_tensor((ELEMS,), Float32)
        halves = cute.zipped_divide(frag, (4,))  # ((4), (2)): the two 16-byte vectors
        for i in cutlass.range_constexpr(2):
            cute.copy(atom, gmem_vector(Float32, addr + i * 16, 4), halves[None, i])
        return frag.load()

    @cute.jit
    def _store_half(self, values, addr: Int64):
        frag = cute.make_rmem_tensor((ELEMS,), self.dtype)
        frag.store(values.to(self.dtype))
        cute.copy(vector_atom(self.dtype), frag, gmem_vector(self.dtype, addr, ELEMS))

    @cute.jit
    def _group_sum(self, value: Float32) -> Float32:
        """Sum over this thread's head-row group (butterfly: the group is `lanes` aligned lanes)."""
        for i in cutlass.range_constexpr(len(self.offsets)):
            value = value + cute.arch.shuffle_sync_bfly(value, offset=self.offsets[i])
        return value

    @cute.jit
    def _partner(self, values):
        """The 8 values of the thread half a head row away (its rotation partner): one 32-bit
        shuffle an element (shuffles move 32 bits)."""
        mine = cute.make_rmem_tensor((ELEMS,), Float32)
        mine.store(values)
        theirs = cute.make_rmem_tensor((ELEMS,), Float32)
        for i in cutlass.range_constexpr(ELEMS):
            theirs[i] = cute.arch.shuffle_sync_bfly(mine[i], offset=self.lanes // 2)
        return theirs.load()

    @cute.kernel
    def kernel(self, q: Int64, k: Int64, q_weight: Int64, k_weight: Int64, table: Int64, positions: Int64, q_out: Int64, k_out: Int64,
               tokens: Int32, q_stride: Int32, k_stride: Int32, eps: Float32):
        tidx, bidx, gdim = launch_indices()
        lane = tidx % self.lanes
        slot = tidx // self.lanes
        col = lane * ELEMS
        half = self.head_dim // 2
        freq = col % half  # the angle index of this thread's first element
        # the first half's elements subtract their partner's sin term, the second half's add it
        sign = Float32(1.0)
        if lane < self.lanes // 2:
            sign = Float32(-1.0)
        if const_expr(self.pdl):
            # q and k come from the projection GEMM before: wait for it (a no-op when not launched
            # as a dependent), then let the next kernel start its prologue
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        rows = tokens * self.per_token
        # every thread runs every iteration (the group's shuffles need all 32 lanes of the warp):
        # a row past the end recomputes the last row and stores nothing
        for first in cutlass.range(bidx * self.rows_per_cta, rows, gdim * self.rows_per_cta):
            row = first + slot
            live = row < rows
            if row >= rows:
                row = rows - 1
            token = row // self.per_token
            head = row - token * self.per_token
            src = k + (Int64(token) * k_stride + (head - self.heads) * self.head_dim + col) * self.ebytes
            dst = k_out + ((Int64(token) * self.kv_heads + head - self.heads) * self.head_dim + col) * self.ebytes
            weight = k_weight + col * self.ebytes
            if head < self.heads:
                src = q + (Int64(token) * q_stride + head * self.head_dim + col) * self.ebytes
                dst = q_out + ((Int64(token) * self.heads + head) * self.head_dim + col) * self.ebytes
                weight = q_weight + col * self.ebytes
            x = self._load_half(src)
            w = self._load_half(weight)
            position = load_scalar(Int64, positions + Int64(token) * 8, 8)
            angles = table + (position * self.head_dim + freq) * 4
            cos = self._load_f32(angles)
            sin = self._load_f32(angles + half * 4)
            squares = self._group_sum((x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            rstd = cute.math.rsqrt(squares * Float32(1.0 / self.head_dim) + eps)
            normed = (x * rstd * w).to(self.dtype).to(Float32)
            partner = self._partner(normed)
            rotated = normed * cos + partner * sin * sign
            if live:
                self._store_half(rotated, dst)
