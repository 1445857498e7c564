"""CuTe DSL building blocks shared by the row kernels (imports cutlass: load lazily).

Addresses come in as raw 64-bit integers and every 16-byte vector pointer is rebuilt with
`assumed_align=16`, so each access compiles to one `ld/st.global.v4.b32` whatever the row
index; the host wrappers check that the tensors really are 16-byte aligned.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

__all__ = ["RowKernel", "cutlass_dtype", "launch_indices", "gmem_vector", "vector_atom", "load_scalar"]

try:  # 4.8 moved it; the old name still works there but warns
    from cutlass.memory import SmemAllocator as _SmemAllocator
except ImportError:  # pragma: no cover
    from cutlass.utils import SmemAllocator as _SmemAllocator


def cutlass_dtype(dtype: torch.dtype):
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def launch_indices():
    """(this thread's index in its CTA, the CTA's index, the grid's CTAs), along x."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    return tidx, bidx, gdim


def vector_atom(dtype):
    """A copy of one 16-byte vector of `dtype` (`ld/st.global.v4.b32` in global memory)."""
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)


def gmem_vector(dtype, addr: Int64, elems: int):
    """The `elems` values of `dtype` at global address `addr`, known to be 16-byte aligned."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout((elems,)))


def load_scalar(dtype, addr: Int64, nbytes: int):
    """One `nbytes`-byte value of `dtype` at global address `addr` (aligned to its size)."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=nbytes)
    return cute.make_tensor(ptr, cute.make_layout((1,)))[0]


class RowKernel:
    """Per-row helpers for a kernel whose CTA holds one row in registers (see tiling.py), built
    from its variant: `dtype`, `tiling()` and (norm kernels) `weight_offset`, gamma's norm
    multiplier being `w + weight_offset`."""

    def __init__(self, variant):
        dtype, tiling = variant.dtype, variant.tiling()
        self.torch_dtype = dtype
        self.dtype = cutlass_dtype(dtype)
        self.ebytes = torch.empty((), dtype=dtype).element_size()
        self.hidden = tiling.hidden
        self.vec = tiling.vec
        self.threads = tiling.threads  # per row
        self.vpt = tiling.vpt
        self.warps = tiling.warps  # per row
        self.full = tiling.full
        self.rows_per_cta = tiling.rows_per_cta
        self.cta_threads = tiling.cta_threads
        #: the staged copies allocate in L1 (`.ca`) instead of reading from L2 alone (`.cg`)
        self.l1_staging = False
        self.weight_offset = float(getattr(variant, "weight_offset", 0.0))

    def _atom(self):
        return vector_atom(self.dtype)

    def _vec_tensor(self, addr: Int64, elem: Int64):
        return gmem_vector(self.dtype, addr + elem * self.ebytes, self.vec)

    def new_frag(self):
        """Registers for this thread's share of one row: (vec, vpt), zero-filled."""
        frag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        frag.fill(0.0)
        return frag

    def new_frags(self, count: int):
        """Registers for this thread's shares of `count` rows: (vec, vpt, count), zero-filled."""
        frags = cute.make_rmem_tensor((self.vec, self.vpt, count), self.dtype)
        frags.fill(0.0)
        return frags

    @cute.jit
    def sum_frags(self, frags: cute.Tensor, count: cutlass.Constexpr, weights=None, extra=None):
        """The fp32 sum of the `count` rows of `frags` (`new_frags`) in order 0..count-1, each
        times `weights[k]` when given (a MoE finalize), then plus the fragment `extra` when given."""
        acc = frags[None, None, 0].load().to(Float32)
        if const_expr(weights is not None):
            acc = acc * weights[0]
        for k in cutlass.range_constexpr(1, count):
            if const_expr(weights is not None):
                acc = acc + frags[None, None, k].load().to(Float32) * weights[k]
            else:
                acc = acc + frags[None, None, k].load().to(Float32)
        if const_expr(extra is not None):
            acc = acc + extra.load().to(Float32)
        return acc

    @cute.jit
    def store_rounded(self, addr: Int64, row_elem: Int64, values, tidx: Int32):
        """fp32 `values` (this thread's share of a row) rounded once to the row's dtype and stored."""
        frag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        frag.store(values.to(self.dtype))
        self.store_row(addr, row_elem, frag, tidx)

    @cute.jit
    def load_row(self, addr: Int64, row_elem: Int64, frag: cute.Tensor, tidx: Int32):
        """frag[:, i] = row[(i * threads + tidx) * vec : ... + vec] for the vectors inside the row."""
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + tidx) * self.vec
            if const_expr(self.full) or col < self.hidden:
                cute.copy(self._atom(), self._vec_tensor(addr, row_elem + col), frag[None, i])

    @cute.jit
    def store_row(self, addr: Int64, row_elem: Int64, frag: cute.Tensor, tidx: Int32):
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + tidx) * self.vec
            if const_expr(self.full) or col < self.hidden:
                cute.copy(self._atom(), frag[None, i], self._vec_tensor(addr, row_elem + col))

    @cute.jit
    def store_vec(self, addr: Int64, elem: Int64, values):
        """One 16-byte vector of fp32 `values`, rounded to the row's dtype, at element `elem`."""
        frag = cute.make_rmem_tensor((self.vec,), self.dtype)
        frag.store(values.to(self.dtype))
        cute.copy(self._atom(), frag, self._vec_tensor(addr, elem))

    def alloc_staging(self):
        """Shared memory for one row of a CTA thread's vectors, laid out (vec, thread, slot) so
        that neighbouring threads' 16-byte vectors are neighbours (no bank conflicts); each
        thread reads back only what it copied, so no barrier is needed between."""
        smem = _SmemAllocator()
        layout = cute.make_layout((self.vec, self.cta_threads, self.vpt), stride=(1, self.vec, self.vec * self.cta_threads))
        return smem.allocate_tensor(self.dtype, layout, byte_alignment=16)

    @cute.jit
    def stage_row(self, addr: Int64, row_elem: Int64, stage: cute.Tensor, lane: Int32, tidx: Int32):
        """Start this thread's vectors of the row on their way to `stage` (cp.async; from L2
        alone unless `l1_staging`: the row is read once, so it need not take L1 space);
        `land_row` waits for them."""
        mode = cute.nvgpu.cpasync.LoadCacheMode.ALWAYS if const_expr(self.l1_staging) else cute.nvgpu.cpasync.LoadCacheMode.GLOBAL
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(mode), self.dtype, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + lane) * self.vec
            if const_expr(self.full) or col < self.hidden:
                cute.copy(atom, self._vec_tensor(addr, row_elem + col), stage[None, tidx, i])

    @cute.jit
    def land_row(self, stage: cute.Tensor, frag: cute.Tensor, lane: Int32, tidx: Int32):
        """frag <- this thread's staged vectors (after `cp_async_wait_group`)."""
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + lane) * self.vec
            if const_expr(self.full) or col < self.hidden:
                frag[None, i].store(stage[None, tidx, i].load())

    def alloc_reduction(self):
        """Two slots per warp: consecutive rows alternate, so one barrier per row suffices."""
        smem = _SmemAllocator()
        return smem.allocate_tensor(Float32, cute.make_layout((self.warps * self.rows_per_cta, 2)), byte_alignment=16)

    @cute.jit
    def block_sum(self, value: Float32, red: cute.Tensor, parity: Int32, tidx: Int32) -> Float32:
        """Sum of `value` over the threads of this thread's row: warp shuffles, then (a row of
        several warps) one shared-memory exchange. `tidx` is the index in the CTA; a row's warps
        are consecutive, so warp w of the CTA serves row w // warps.

        The warp and lane numbers are plain arithmetic on `tidx`, never `cute.arch.warp_idx()`:
        that one is marked warp-uniform with a full-mask `shfl.sync`, and a full-mask shuffle
        executed by lane 0 alone (inside the `lane == 0` branch) waits forever for lanes
        1..31, which wait at the barrier below: the whole CTA deadlocks (docs/kernels.md)."""
        value = cute.arch.warp_reduction_sum(value)
        total = value
        if const_expr(self.warps > 1):
            warp = tidx // 32
            lane = tidx % 32
            if lane == 0:
                red[warp, parity] = value
            cute.arch.sync_threads()
            if const_expr(self.rows_per_cta == 1):
                total = red[0, parity]
                for w in cutlass.range_constexpr(1, self.warps):
                    total = total + red[w, parity]
            else:
                first = (warp // self.warps) * self.warps
                total = red[first, parity]
                for w in cutlass.range_constexpr(1, self.warps):
                    total = total + red[first + w, parity]
        return total

    @cute.jit
    def load_gamma(self, gamma: Int64, tidx: Int32, weight_offset: cutlass.Constexpr):
        """The norm multiplier (w + weight_offset) of this thread's columns, in fp32 registers."""
        gfrag = self.new_frag()
        self.load_row(gamma, Int64(0), gfrag, tidx)
        return self.widen_gamma(gfrag, weight_offset)

    @cute.jit
    def widen_gamma(self, gfrag: cute.Tensor, weight_offset: cutlass.Constexpr):
        """The fp32 norm multiplier (w + weight_offset) of gamma values as loaded (a fragment or
        one vector of it)."""
        g = gfrag.load().to(Float32)
        if const_expr(weight_offset != 0.0):
            g = g + Float32(weight_offset)
        return g

    @cute.jit
    def norm_and_store(
        self,
        total,
        gam,
        eps: Float32,
        red: cute.Tensor,
        parity: Int32,
        residual_out: Int64,
        out: Int64,
        row_elem: Int64,
        lane: Int32,
        tidx: Int32,
        live=None,
        gamma=None,
    ):
        """Write round(total) as the new residual and round(total * rstd * gamma) as the norm,
        where rstd = 1/sqrt(mean(total^2) + eps) over the row (fp32 throughout). `lane`: the
        thread's index in its row; `tidx`: in the CTA (the reduction's); `live` (multi-row CTAs): False for a
        row past the end, which reduces with the others but stores nothing. `gam` None: gamma
        is read from address `gamma` now, as loaded, and widened for the norm only (while the
        reduction runs, so its latency hides there)."""
        rfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        rfrag.store(total.to(self.dtype))
        if const_expr(live is None):
            self.store_row(residual_out, row_elem, rfrag, lane)
        else:
            if live:
                self.store_row(residual_out, row_elem, rfrag, lane)
        gfrag = None
        if const_expr(gam is None):
            gfrag = self.new_frag()
            self.load_row(gamma, Int64(0), gfrag, lane)
        sq = (total * total).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        sq = self.block_sum(sq, red, parity, tidx)
        rstd = cute.math.rsqrt(sq * Float32(1.0 / self.hidden) + eps)
        if const_expr(gam is None):
            gam = self.widen_gamma(gfrag, self.weight_offset)
        nfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        nfrag.store((total * rstd * gam).to(self.dtype))
        if const_expr(live is None):
            self.store_row(out, row_elem, nfrag, lane)
        else:
            if live:
                self.store_row(out, row_elem, nfrag, lane)
