"""One-shot all-reduce over peer buffers + residual add + RMSNorm in CuTe DSL (imports cutlass).

One launch per rank of the group; every rank runs the same rows in the same order. For each row
`t` a CTA (a persistent grid: at most one CTA per SM, looping over rows):

1. computes this rank's partial row (the input row, or the MoE finalize of its expert rows in
   fp32) and rounds it once to the row dtype, keeps it in registers and stores it to its own
   `staging[epoch % 2][t]`;
2. `bar.sync`; threads p < world, p != rank: `fence.acq_rel.sys`, then a relaxed sys-scope store of
   `epoch` into rank p's `flags[rank, t]` (a release: the staging row is visible before the flag);
3. the same threads spin on this rank's `flags[p, t]` with `ld.acquire.sys` until it is >= epoch
   (a faster peer may already have written epoch + 1), bounded by a timeout after which the
   thread writes what it waited for to host memory and traps; `bar.sync`;
4. reads row t of every rank's staging in rank order 0..world-1 with L1-bypassing loads
   (`ld.global.cg`), sums in fp32 in that order (so every rank computes bit-identical values),
   adds the residual and normalizes (`RowKernel.norm_and_store`).

The epoch is `state[0] + 1`, read by every CTA at its start; the last CTA to finish (an atomic
count in `state[1]`) stores it back, so the next launch on the stream, eager or a graph
replay, uses the next epoch without any host argument changing. See docs/fused_allreduce.md for
why two staging buffers are enough.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .allreduce_layout import FLAG_BYTES, N_ADDRESSES, AllReduceVariant
from .dsl_rows import RowKernel, launch_indices, load_scalar
from .norms_dsl import NormsRow

__all__ = ["AllReduceAddRMSNormKernel", "AllReduceNormsKernel", "N_ADDRESSES"]


@dsl_user_op
def _trap(*, loc=None, ip=None):
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, loc=loc, ip=ip)


class AllReduceAddRMSNormKernel(RowKernel):
    def __init__(self, variant: AllReduceVariant):
        super().__init__(variant)
        self.world = variant.world
        self.top_k = variant.top_k
        self.has_shared = variant.shared
        self.row_stride = variant.row_stride

    @cute.jit
    def __call__(self, src: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64,
                 state: Int64, diag: Int64, own: Int64, b0: Int64, b1: Int64, b2: Int64, b3: Int64, b4: Int64, b5: Int64, b6: Int64,
                 b7: Int64, rows: Int32, rank: Int32, capacity: Int32, eps: Float32, grid: Int32, stream: cuda.CUstream):
        self.kernel(
            src, weights, shared, residual, gamma, residual_out, out, state, diag, own,
            b0, b1, b2, b3, b4, b5, b6, b7, rows, rank, capacity, eps,
        ).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------- helpers
    def _peer_atom(self):
        """16-byte loads that bypass L1 (`ld.global.cg`): a peer's row is never served from a
        line this SM cached before the peer's flag arrived."""
        return cute.make_copy_atom(
            cute.nvgpu.CopyG2ROp(), self.dtype, num_bits_per_copy=128, load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL
        )

    @cute.jit
    def _load_peer_row(self, addr: Int64, frag: cute.Tensor, tidx: Int32):
        for i in cutlass.range_constexpr(self.vpt):
            col = (i * self.threads + tidx) * self.vec
            if const_expr(self.full) or col < self.hidden:
                cute.copy(self._peer_atom(), self._vec_tensor(addr, Int64(col)), frag[None, i])

    def _i64(self, addr: Int64):
        return cute.make_ptr(Int64, addr, cute.AddressSpace.gmem, assumed_align=8)

    @cute.jit
    def _partial(self, src: Int64, weights: Int64, shared: Int64, row: Int32, row_elem: Int64, tidx: Int32):
        """This rank's partial row in fp32: the input row, or sum_k w[t,k] * rows[t,k] (+ shared)."""
        if const_expr(self.top_k == 0):
            xf = self.new_frag()
            self.load_row(src, row_elem, xf, tidx)
            return xf.load().to(Float32)
        else:
            top_k = self.top_k
            sf = None
            if const_expr(self.has_shared):
                sf = self.new_frag()
                self.load_row(shared, row_elem, sf, tidx)
            wts = cute.make_rmem_tensor((top_k,), Float32)
            base = Int64(row) * top_k
            for k in cutlass.range_constexpr(top_k):
                wts[k] = load_scalar(Float32, weights + (base + k) * 4, 4)
            ef = self.new_frags(top_k)
            for k in cutlass.range_constexpr(top_k):
                self.load_row(src, (base + k) * self.hidden, ef[None, None, k], tidx)
            return self.sum_frags(ef, top_k, wts, sf)

    @cute.jit
    def _wait(self, flag: Int64, epoch: Int64, timeout: Int64, diag: Int64, rank: Int32, peer: Int32, row: Int32):
        """Spin until flags word `flag` holds >= epoch; past `timeout` ns report and trap."""
        fptr = self._i64(flag)
        seen = cute.arch.load(fptr, Int64, sem="acquire", scope="sys")
        if seen < epoch:
            start = cute.arch.globaltimer()
            while seen < epoch:
                seen = cute.arch.load(fptr, Int64, sem="acquire", scope="sys")
                waited = cute.arch.globaltimer() - start
                if waited > timeout:
                    dptr = self._i64(diag)
                    cute.arch.store(dptr + 1, Int64(rank), sem="relaxed", scope="sys")
                    cute.arch.store(dptr + 2, Int64(peer), sem="relaxed", scope="sys")
                    cute.arch.store(dptr + 3, Int64(row), sem="relaxed", scope="sys")
                    cute.arch.store(dptr + 4, epoch, sem="relaxed", scope="sys")
                    cute.arch.store(dptr + 5, seen, sem="relaxed", scope="sys")
                    cute.arch.store(dptr + 6, waited, sem="relaxed", scope="sys")
                    cute.arch.store(dptr, Int64(1), sem="release", scope="sys")
                    cute.arch.fence_acq_rel_sys()
                    _trap()

    @cute.jit
    def _setup(self, state: Int64, own: Int64, bases, rank: Int32, capacity: Int32, tidx: Int32):
        """What every row of the launch shares: the state pointer, this call's epoch, the spin
        timeout, the staging rows' offset (of the epoch's parity), the capacity, the peer whose
        flag this thread writes and waits for (threads world.. do neither), and whether it does."""
        world = self.world
        sptr = self._i64(state)
        epoch = cute.arch.load(sptr, Int64, sem="relaxed", scope="gpu") + Int64(1)
        timeout = cute.arch.load(sptr + 2, Int64, sem="relaxed", scope="gpu")
        parity = epoch % 2
        cap = Int64(capacity)
        flags_bytes = Int64(world) * cap * FLAG_BYTES
        staging = (flags_bytes + 255) // 256 * 256 + parity * cap * self.row_stride
        peer = Int32(tidx)
        peer_base = bases[0]
        for r in cutlass.range_constexpr(1, world):
            peer_base = cutlass.select_(peer == r, bases[r], peer_base)
        signals = tidx < world and peer != rank
        return sptr, epoch, timeout, staging, cap, peer, peer_base, signals

    @cute.jit
    def _exchange_row(self, row: Int32, row_elem: Int64, partial, own: Int64, bases, staging: Int64, cap: Int64, peer: Int32,
                      peer_base: Int64, signals, epoch: Int64, timeout: Int64, diag: Int64, rank: Int32, tidx: Int32):
        """Publish this rank's `partial` row (fp32, rounded once here) in its staging, raise the
        epoch in each peer's flag, wait for each peer's, and load row `row` of every rank's
        staging: the (world, ...) fragments, in rank order."""
        pfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
        pfrag.store(partial.to(self.dtype))  # rounded once: what every rank sums
        staged = staging + Int64(row) * self.row_stride
        self.store_row(own + staged, Int64(0), pfrag, tidx)
        cute.arch.sync_threads()  # the whole row is stored before any flag goes out
        if signals:
            cute.arch.fence_acq_rel_sys()
            flag_out = peer_base + (Int64(rank) * cap + Int64(row)) * FLAG_BYTES
            cute.arch.store(self._i64(flag_out), epoch, sem="relaxed", scope="sys")
            flag_in = own + (Int64(peer) * cap + Int64(row)) * FLAG_BYTES
            self._wait(flag_in, epoch, timeout, diag, rank, peer, row)
        cute.arch.sync_threads()  # every peer's row t is published
        peers = self.new_frags(self.world)
        for r in cutlass.range_constexpr(self.world):
            self._load_peer_row(bases[r] + staged, peers[None, None, r], tidx)
        return peers

    @cute.jit
    def _hand_on_epoch(self, sptr, epoch: Int64, gdim: Int32, tidx: Int32):
        """The last CTA out stores the epoch for the next launch (every CTA read it before this)."""
        cute.arch.sync_threads()
        if tidx == 0:
            arrived = cute.arch.atomic_add(sptr + 1, Int64(1), sem="acq_rel", scope="gpu")
            if arrived == Int64(gdim) - 1:
                cute.arch.store(sptr + 1, Int64(0), sem="relaxed", scope="gpu")
                cute.arch.store(sptr, epoch, sem="relaxed", scope="gpu")

    # -------------------------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(self, src: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64,
               state: Int64, diag: Int64, own: Int64, b0: Int64, b1: Int64, b2: Int64, b3: Int64, b4: Int64, b5: Int64, b6: Int64,
               b7: Int64, rows: Int32, rank: Int32, capacity: Int32, eps: Float32):
        tidx, bidx, gdim = launch_indices()
        bases = [b0, b1, b2, b3, b4, b5, b6, b7][: self.world]
        red = self.alloc_reduction()
        gam = self.load_gamma(gamma, tidx, self.weight_offset)
        sptr, epoch, timeout, staging, cap, peer, peer_base, signals = self._setup(state, own, bases, rank, capacity, tidx)
        red_parity = Int32(0)
        for row in cutlass.range(bidx, rows, gdim):
            row_elem = Int64(row) * self.hidden
            rf = self.new_frag()
            self.load_row(residual, row_elem, rf, tidx)
            part = self._partial(src, weights, shared, row, row_elem, tidx)
            peers = self._exchange_row(row, row_elem, part, own, bases, staging, cap, peer, peer_base, signals, epoch, timeout, diag, rank,
                                       tidx)
            total = self.sum_frags(peers, self.world, extra=rf)
            self.norm_and_store(total, gam, eps, red, red_parity, residual_out, out, row_elem, tidx, tidx)
            red_parity = 1 - red_parity
        self._hand_on_epoch(sptr, epoch, gdim, tidx)


class AllReduceNormsKernel(AllReduceAddRMSNormKernel, NormsRow):
    """The one-shot all-reduce with the norms of the variant's `NormsShape` (norms_dsl.py): the
    group's sum (rounded once when a post-norm follows, as the unfused all-reduce hands it on),
    the post-norm, the residual add, the read's norm. The exchange is the add + RMSNorm kernel's;
    the arguments are its own plus beta, post_gamma and post_eps."""

    def __init__(self, variant):
        super().__init__(variant)
        self.set_shape(variant.shape)

    @cute.jit
    def __call__(self, src: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64,
                 state: Int64, diag: Int64, own: Int64, b0: Int64, b1: Int64, b2: Int64, b3: Int64, b4: Int64, b5: Int64, b6: Int64,
                 b7: Int64, beta: Int64, post_gamma: Int64, rows: Int32, rank: Int32, capacity: Int32, eps: Float32, post_eps: Float32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(
            src, weights, shared, residual, gamma, residual_out, out, state, diag, own,
            b0, b1, b2, b3, b4, b5, b6, b7, beta, post_gamma, rows, rank, capacity, eps, post_eps,
        ).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: Int64, weights: Int64, shared: Int64, residual: Int64, gamma: Int64, residual_out: Int64, out: Int64,
               state: Int64, diag: Int64, own: Int64, b0: Int64, b1: Int64, b2: Int64, b3: Int64, b4: Int64, b5: Int64, b6: Int64,
               b7: Int64, beta: Int64, post_gamma: Int64, rows: Int32, rank: Int32, capacity: Int32, eps: Float32, post_eps: Float32):
        tidx, bidx, gdim = launch_indices()
        bases = [b0, b1, b2, b3, b4, b5, b6, b7][: self.world]
        red = self.alloc_reduction()
        gam, bet, pg = self.load_weights(gamma, beta, post_gamma, tidx)
        sptr, epoch, timeout, staging, cap, peer, peer_base, signals = self._setup(state, own, bases, rank, capacity, tidx)
        parity = Int32(0)
        for row in cutlass.range(bidx, rows, gdim):
            row_elem = Int64(row) * self.hidden
            rf = self.new_frag()
            self.load_row(residual, row_elem, rf, tidx)
            part = self._partial(src, weights, shared, row, row_elem, tidx)
            peers = self._exchange_row(row, row_elem, part, own, bases, staging, cap, peer, peer_base, signals, epoch, timeout, diag, rank,
                                       tidx)
            if const_expr(self.post):
                summed = self.sum_frags(peers, self.world)
                sfrag = cute.make_rmem_tensor((self.vec, self.vpt), self.dtype)
                sfrag.store(summed.to(self.dtype))  # the completed sum, rounded once
                xv, parity = self.post_norm(sfrag.load().to(Float32), pg, post_eps, red, parity, tidx)
                total = xv + rf.load().to(Float32)
            else:
                total = self.sum_frags(peers, self.world, extra=rf)
            parity = self.store_norms(total, gam, bet, eps, red, parity, residual_out, out, row_elem, tidx, tidx)
        self._hand_on_epoch(sptr, epoch, gdim, tidx)
