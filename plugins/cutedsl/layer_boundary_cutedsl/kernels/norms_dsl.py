"""The norms around a residual add in CuTe DSL (imports cutlass: load lazily): an RMSNorm
post-norm of the output before the add, then the read's RMSNorm, LayerNorm or nothing
(`norms.NormsShape`). `NormsRow` is the per-row math, shared by the local kernel here and the
one-shot all-reduce variant (allreduce_dsl.py); `AddNormsKernel` is the local launch.

A CTA holds one row in registers, so every statistic needs no second read: the post-norm's sum of
squares, then the read's (a LayerNorm's mean, then the sum of the centered squares of the row's
own columns). Each statistic is one block reduction; consecutive reductions alternate between
the two shared-memory slots, so one barrier each suffices.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .dsl_rows import RowKernel, launch_indices

__all__ = ["NormsRow", "AddNormsKernel"]


class NormsRow(RowKernel):
    """Per-row helpers of the norms kernels; `shape` is the variant's `NormsShape`."""

    def set_shape(self, shape) -> None:
        self.norm = shape.norm
        self.weight_offset = float(shape.weight_offset)
        self.has_bias = bool(shape.bias)
        self.post = bool(shape.post)
        self.post_offset = float(shape.post_offset)

    @cute.jit
    def load_weights(self, gamma: Int64, beta: Int64, post_gamma: Int64, lane: Int32):
        """(the read's multiplier, its bias, the post-norm's multiplier), fp32, this thread's
        columns; None for what the shape does not have."""
        gam = None
        bet = None
        pg = None
        if const_expr(self.norm != "none"):
            gam = self.load_gamma(gamma, lane, self.weight_offset)
        if const_expr(self.has_bias):
            bet = self.load_gamma(beta, lane, 0.0)
        if const_expr(self.post):
            pg = self.load_gamma(post_gamma, lane, self.post_offset)
        return gam, bet, pg

    @cute.jit
    def post_norm(self, x, pg, post_eps: Float32, red: cute.Tensor, parity: Int32, tidx: Int32):
        """x (fp32, this thread's share of the row) through the RMS post-norm, rounded once to the
        row dtype (what the unfused path adds), back in fp32; and the next reduction slot."""
        sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        sq = self.block_sum(sq, red, parity, tidx)
        rstd = cute.math.rsqrt(sq * Float32(1.0 / self.hidden) + post_eps)
        frag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        frag.store((x * rstd * pg).to(self.dtype))
        return frag.load().to(Float32), 1 - parity

    @cute.jit
    def centered_squares(self, total, mean: Float32, lane: Int32) -> Float32:
        """The sum of (total - mean)^2 over this thread's columns inside the row (a column past
        the end holds 0, whose centered square is not the row's)."""
        tf = cute.make_rmem_tensor((self.vec, self.vpt), Float32)
        tf.store(total)
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + lane) * self.vec
            if const_expr(self.full) or col < self.hidden:
                d = tf[None, i].load() - mean
                sq = sq + (d * d).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return sq

    @cute.jit
    def store_norms(self, total, gam, bet, eps: Float32, red: cute.Tensor, parity: Int32, residual_out: Int64, out: Int64,
                    row_elem: Int64, lane: Int32, tidx: Int32):
        """Store round(total) as the new residual and the read's norm of the unrounded total (none
        for an identity read); returns the next reduction slot."""
        rfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        rfrag.store(total.to(self.dtype))
        self.store_row(residual_out, row_elem, rfrag, lane)
        if const_expr(self.norm == "rms"):
            sq = (total * total).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            sq = self.block_sum(sq, red, parity, tidx)
            parity = 1 - parity
            rstd = cute.math.rsqrt(sq * Float32(1.0 / self.hidden) + eps)
            nfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
            nfrag.store((total * rstd * gam).to(self.dtype))
            self.store_row(out, row_elem, nfrag, lane)
        if const_expr(self.norm == "layer"):
            s = total.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            s = self.block_sum(s, red, parity, tidx)
            parity = 1 - parity
            mean = s * Float32(1.0 / self.hidden)
            sq = self.block_sum(self.centered_squares(total, mean, lane), red, parity, tidx)
            parity = 1 - parity
            rstd = cute.math.rsqrt(sq * Float32(1.0 / self.hidden) + eps)
            y = (total - mean) * rstd * gam
            if const_expr(self.has_bias):
                y = y + bet
            nfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
            nfrag.store(y.to(self.dtype))
            self.store_row(out, row_elem, nfrag, lane)
        return parity


class AddNormsKernel(NormsRow):
    """Arguments (addresses of row-major, 16-byte aligned rows of `hidden` elements; 0 where the
    shape has no such tensor): x, residual, gamma, beta, post_gamma -> residual_out, out; `rows`
    tokens; eps, post_eps; `grid` CTAs looping over rows. Launched as a programmatic dependent
    (PDL), as the add + RMSNorm kernel is."""

    def __init__(self, variant):
        super().__init__(variant)
        self.set_shape(variant.shape)
        self.pdl = bool(variant.pdl)

    @cute.jit
    def __call__(self, x: Int64, residual: Int64, gamma: Int64, beta: Int64, post_gamma: Int64, residual_out: Int64, out: Int64,
                 rows: Int32, eps: Float32, post_eps: Float32, grid: Int32, stream: cuda.CUstream):
        self.kernel(x, residual, gamma, beta, post_gamma, residual_out, out, rows, eps, post_eps).launch(
            grid=[grid, 1, 1], block=[self.cta_threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, x: Int64, residual: Int64, gamma: Int64, beta: Int64, post_gamma: Int64, residual_out: Int64, out: Int64,
               rows: Int32, eps: Float32, post_eps: Float32):
        tidx, bidx, gdim = launch_indices()
        red = self.alloc_reduction()
        gam, bet, pg = self.load_weights(gamma, beta, post_gamma, tidx)  # weights: read before the wait
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        parity = Int32(0)
        for row in cutlass.range(bidx, rows, gdim):
            row_elem = Int64(row) * self.hidden
            xf = self.new_frag()
            rf = self.new_frag()
            self.load_row(x, row_elem, xf, tidx)
            self.load_row(residual, row_elem, rf, tidx)
            xv = xf.load().to(Float32)
            if const_expr(self.post):
                xv, parity = self.post_norm(xv, pg, post_eps, red, parity, tidx)
            total = xv + rf.load().to(Float32)
            parity = self.store_norms(total, gam, bet, eps, red, parity, residual_out, out, row_elem, tidx, tidx)
