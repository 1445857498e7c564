"""Fused residual add + RMSNorm in CuTe DSL (imports cutlass: load lazily).

One pass over HBM: read x and residual, write the new residual (x + residual rounded once)
and the norm of the unrounded fp32 sum. The CTA holds a whole row in registers, so the sum
of squares needs no second read. Launched as a programmatic dependent by default (PDL), as
FlashInfer's norms are: back-to-back launches overlap their prologues, which is most of a
small call's time.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .dsl_rows import RowKernel, launch_indices
from .tiling import AddNormVariant

__all__ = ["AddRMSNormKernel"]


class AddRMSNormKernel(RowKernel):
    """Arguments (all addresses of row-major, 16-byte aligned rows of `hidden` elements):
    x, residual, gamma -> residual_out, out; `rows` tokens; `grid` CTAs (grid-stride over blocks
    of `rows_per_cta` rows: a CTA's rows side by side, each on its own `threads` threads).
    residual_out may alias residual and out may alias x (each element is read before it is written
    by the same thread)."""

    def __init__(self, variant: AddNormVariant):
        super().__init__(variant)
        self.pdl = bool(variant.pdl)
        self.staged = bool(variant.staged)
        self.late_trigger = bool(variant.late_trigger)
        self.reread = bool(variant.reread)
        self.ctas_per_sm = int(variant.ctas_per_sm)
        self.late_gamma = bool(variant.late_gamma)
        self.l1_staging = bool(variant.l1_staging)
        self.no_loop = bool(variant.no_loop)

    @cute.jit
    def __call__(self, x: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64, rows: Int32, eps: Float32, grid: Int32,
                 stream: cuda.CUstream):
        occupancy = {}
        if const_expr(self.staged or self.ctas_per_sm > 0):
            # all of the SM's unified memory as shared memory: left to the driver, the carveout
            # a staged kernel gets depends on what ran before in the process (the same 64x2
            # staged kernel at T=1024 H=4096 then holds 3 CTAs an SM instead of 4 and runs 1.2x
            # slower). Named outright, it also spares the DSL asking a device for its shared
            # memory, so compilation needs none.
            occupancy = dict(preferred_smem_carveout=100)
        if const_expr(self.ctas_per_sm > 0):
            occupancy["min_blocks_per_mp"] = self.ctas_per_sm
        self.kernel(x, residual, gamma, residual_out, out, rows, eps).launch(
            grid=[grid, 1, 1], block=[self.cta_threads, 1, 1], stream=stream, use_pdl=self.pdl, **occupancy
        )

    @cute.jit
    def load_inputs(self, x: Int64, residual: Int64, row_elem: Int64, xf: cute.Tensor, rf: cute.Tensor, lane: Int32, tidx: Int32, staging):
        """xf, rf <- this thread's vectors of the row of x and of the residual: straight into
        registers, or (staged) through `staging`'s two shared-memory buffers with cp.async."""
        if const_expr(self.staged):
            sx, sr = staging
            self.stage_row(x, row_elem, sx, lane, tidx)
            self.stage_row(residual, row_elem, sr, lane, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            self.land_row(sx, xf, lane, tidx)
            self.land_row(sr, rf, lane, tidx)
        else:
            self.load_row(x, row_elem, xf, lane)
            self.load_row(residual, row_elem, rf, lane)

    @cute.jit
    def stage_inputs(self, x: Int64, residual: Int64, row_elem: Int64, lane: Int32, tidx: Int32, staging):
        """This thread's vectors of the row of x and of the residual into `staging` (cp.async),
        waited for: `reread_norm_and_store` reads them from there, twice."""
        sx, sr = staging
        self.stage_row(x, row_elem, sx, lane, tidx)
        self.stage_row(residual, row_elem, sr, lane, tidx)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def reread_norm_and_store(self, staging, gam: cute.Tensor, eps: Float32, red: cute.Tensor, parity: Int32, residual_out: Int64, out: Int64, row_elem: Int64, lane: Int32, tidx: Int32, live=None):
        """`norm_and_store` for a staged row summed vector by vector from shared memory: once for
        the new residual and the sum of squares, again after the reduction for the norm, so that
        only one vector's sum is live at a time. Same roundings as the register path. A row past
        the end (`live` False) reduces garbage with its own threads only and stores nothing."""
        sx, sr = staging
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + lane) * self.vec
            if const_expr(self.full) or col < self.hidden:
                total = sx[None, tidx, i].load().to(Float32) + sr[None, tidx, i].load().to(Float32)
                if const_expr(live is None):
                    self.store_vec(residual_out, row_elem + col, total)
                else:
                    if live:
                        self.store_vec(residual_out, row_elem + col, total)
                sq = sq + (total * total).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        sq = self.block_sum(sq, red, parity, tidx)
        rstd = cute.math.rsqrt(sq * Float32(1.0 / self.hidden) + eps)
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + lane) * self.vec
            if const_expr(self.full) or col < self.hidden:
                total = sx[None, tidx, i].load().to(Float32) + sr[None, tidx, i].load().to(Float32)
                g = self.widen_gamma(gam[None, i], self.weight_offset)
                if const_expr(live is None):
                    self.store_vec(out, row_elem + col, total * rstd * g)
                else:
                    if live:
                        self.store_vec(out, row_elem + col, total * rstd * g)

    @cute.jit
    def row_gamma(self, gam, gamma: Int64, lane: Int32):
        """The reread norm's gamma fragment (as loaded): the one read before the rows, or with
        `late_gamma` this row's own read."""
        if const_expr(gam is None):
            gam = self.new_frag()
            self.load_row(gamma, Int64(0), gam, lane)
        return gam

    @cute.jit
    def one_row(self, row, x: Int64, residual: Int64, gamma: Int64, gam, residual_out: Int64, out: Int64, eps: Float32, red: cute.Tensor, parity: Int32, lane: Int32, tidx: Int32, staging):
        """Row `row` of a one-row CTA: loaded, summed, stored, normalized, stored."""
        row_elem = Int64(row) * self.hidden
        if const_expr(self.reread):
            self.stage_inputs(x, residual, row_elem, lane, tidx, staging)
            self.reread_norm_and_store(staging, self.row_gamma(gam, gamma, lane), eps, red, parity, residual_out, out, row_elem, lane, tidx)
        else:
            xf = self.new_frag()
            rf = self.new_frag()
            self.load_inputs(x, residual, row_elem, xf, rf, lane, tidx, staging)
            total = xf.load().to(Float32) + rf.load().to(Float32)
            self.norm_and_store(total, gam, eps, red, parity, residual_out, out, row_elem, lane, tidx, gamma=gamma)

    @cute.jit
    def one_block(self, first, group: Int32, rows: Int32, x: Int64, residual: Int64, gamma: Int64, gam, residual_out: Int64, out: Int64, eps: Float32, red: cute.Tensor, parity: Int32, lane: Int32, tidx: Int32, staging):
        """The block of rows from `first` of a multi-row CTA, this thread's row `first + group`.
        Every thread runs it (the row's reduction may need the CTA's barrier); a row past the
        end loads zeros and stores nothing."""
        row = first + group
        live = row < rows
        row_elem = Int64(row) * self.hidden
        if const_expr(self.reread):
            if live:
                self.stage_inputs(x, residual, row_elem, lane, tidx, staging)
            self.reread_norm_and_store(staging, self.row_gamma(gam, gamma, lane), eps, red, parity, residual_out, out, row_elem, lane, tidx, live)
        else:
            xf = self.new_frag()
            rf = self.new_frag()
            if live:
                self.load_inputs(x, residual, row_elem, xf, rf, lane, tidx, staging)
            total = xf.load().to(Float32) + rf.load().to(Float32)
            self.norm_and_store(total, gam, eps, red, parity, residual_out, out, row_elem, lane, tidx, live, gamma=gamma)

    @cute.kernel
    def kernel(self, x: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64, rows: Int32, eps: Float32):
        tidx, bidx, gdim = launch_indices()
        red = self.alloc_reduction()
        staging = (self.alloc_staging(), self.alloc_staging()) if const_expr(self.staged) else None
        if const_expr(self.rows_per_cta == 1):
            lane = tidx
            group = Int32(0)
        else:
            lane = tidx % self.threads
            group = tidx // self.threads
        gam = None  # late_gamma: read per row, after the wait
        if const_expr(self.reread and not self.late_gamma):
            # kept as loaded (half the registers of fp32); widened vector by vector at the norm
            gam = self.new_frag()
            self.load_row(gamma, Int64(0), gam, lane)
        elif const_expr(not self.late_gamma):
            gam = self.load_gamma(gamma, lane, self.weight_offset)
        if const_expr(self.pdl):
            # x and the residual may come from the kernel before: wait for it to finish (a no-op
            # when not launched as a dependent), and let the kernel after start its own prologue
            # (at once; a late trigger lets it in only once this CTA's rows are done, so that its
            # waiting CTAs take no SM room from this kernel's later CTAs)
            cute.arch.griddepcontrol_wait()
            if const_expr(not self.late_trigger):
                cute.arch.griddepcontrol_launch_dependents()
        parity = Int32(0)
        if const_expr(self.no_loop):
            # one block of rows a CTA, the launch giving every block its CTA: no grid-stride loop
            # (ptxas adds an L2 prefetch hint to cp.async inside a loop, `LDGSTS.E.LTC128B`, and
            # not outside one, as in FlashInfer's kernel)
            if const_expr(self.rows_per_cta == 1):
                self.one_row(bidx, x, residual, gamma, gam, residual_out, out, eps, red, parity, lane, tidx, staging)
            else:
                self.one_block(bidx * self.rows_per_cta, group, rows, x, residual, gamma, gam, residual_out, out, eps, red, parity, lane, tidx, staging)
        elif const_expr(self.rows_per_cta == 1):
            for row in cutlass.range(bidx, rows, gdim):
                self.one_row(row, x, residual, gamma, gam, residual_out, out, eps, red, parity, lane, tidx, staging)
                parity = 1 - parity
        else:
            for first in cutlass.range(bidx * self.rows_per_cta, rows, gdim * self.rows_per_cta):
                self.one_block(first, group, rows, x, residual, gamma, gam, residual_out, out, eps, red, parity, lane, tidx, staging)
                parity = 1 - parity
        if const_expr(self.pdl and self.late_trigger):
            cute.arch.griddepcontrol_launch_dependents()
