"""MoE finalize (+ residual add + RMSNorm) in CuTe DSL (imports cutlass: load lazily).

Per token t: acc = sum_k weights[t,k] * routed[indices[t,k]] (+ shared[t]) in fp32 registers;
then either write round(acc) (the `norm=False` variant, for a collective to run next) or add
the residual and normalize as the add + RMSNorm kernel does, without rounding acc first.
The index convention is the one documented in reference.py.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .dsl_rows import RowKernel, launch_indices, load_scalar
from .tiling import MoeVariant

__all__ = ["MoeFinalizeKernel"]


class MoeFinalizeKernel(RowKernel):
    """Arguments: routed [R, hidden], indices int32 [rows, top_k] (ignored when not `indexed`),
    weights fp32 [rows, top_k], shared [rows, hidden] (ignored without `shared`), residual and
    gamma (ignored without `norm`) -> residual_out (ignored without `norm`), out. Addresses of
    unused arguments may be 0."""

    def __init__(self, variant: MoeVariant):
        super().__init__(variant)
        self.top_k = variant.top_k
        self.indexed = variant.indexed
        self.has_shared = variant.shared
        self.norm = variant.norm

    @cute.jit
    def __call__(self, routed: Int64, indices: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64,
                 out: Int64, rows: Int32, eps: Float32, grid: Int32, stream: cuda.CUstream):
        self.kernel(routed, indices, weights, shared, residual, gamma, residual_out, out, rows, eps).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.jit
    def _routing(self, indices: Int64, weights: Int64, row: Int32, src: cute.Tensor, wts: cute.Tensor):
        """src[k] = routed row of slot k (negative: skip), wts[k] = its weight (0 when skipped).

        All 2 * top_k scalar loads are issued before any is used (no branch between them)."""
        base = Int64(row) * self.top_k
        for k in cutlass.range_constexpr(self.top_k):
            wts[k] = load_scalar(Float32, weights + (base + k) * 4, 4)
            if const_expr(self.indexed):
                src[k] = load_scalar(Int32, indices + (base + k) * 4, 4)
            else:
                src[k] = Int32(base + k)
        if const_expr(self.indexed):
            # a skipped slot's weight may be garbage (even inf/nan): force it to 0
            for k in cutlass.range_constexpr(self.top_k):
                wts[k] = Float32(cutlass.select_(src[k] >= 0, wts[k], Float32(0.0)))

    @cute.kernel
    def kernel(self, routed: Int64, indices: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64,
               out: Int64, rows: Int32, eps: Float32):
        tidx, bidx, gdim = launch_indices()
        top_k = self.top_k
        red = None
        gam = None
        if const_expr(self.norm):
            red = self.alloc_reduction()
            gam = self.load_gamma(gamma, tidx, self.weight_offset)
        parity = Int32(0)
        for row in cutlass.range(bidx, rows, gdim):
            row_elem = Int64(row) * self.hidden
            # loads that need no routing first, so they are in flight while the indices arrive
            sf = None
            if const_expr(self.has_shared):
                sf = self.new_frag()
                self.load_row(shared, row_elem, sf, tidx)
            rf = None
            if const_expr(self.norm):
                rf = self.new_frag()
                self.load_row(residual, row_elem, rf, tidx)
            src = cute.make_rmem_tensor((top_k,), Int32)
            wts = cute.make_rmem_tensor((top_k,), Float32)
            self._routing(indices, weights, row, src, wts)
            # every expert row of this token in flight at once (top_k * vpt vectors per thread)
            ef = self.new_frags(top_k)
            for k in cutlass.range_constexpr(top_k):
                if const_expr(self.indexed):
                    if src[k] >= 0:
                        self.load_row(routed, Int64(src[k]) * self.hidden, ef[None, None, k], tidx)
                else:
                    self.load_row(routed, Int64(src[k]) * self.hidden, ef[None, None, k], tidx)
            acc = self.sum_frags(ef, top_k, wts, sf)
            if const_expr(self.norm):
                total = acc + rf.load().to(Float32)
                self.norm_and_store(total, gam, eps, red, parity, residual_out, out, row_elem, tidx, tidx)
            else:
                self.store_rounded(out, row_elem, acc, tidx)
            parity = 1 - parity
