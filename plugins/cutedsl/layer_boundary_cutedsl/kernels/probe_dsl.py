"""Minimal CuTe DSL kernels for `gpu_diagnose.py`'s ladder (imports cutlass: load lazily).

Each isolates one thing the real kernels rely on, so a failure on a new machine names its layer:
the DSL launching at all (`WriteOne`), our address-and-stream calling convention, a CTA barrier
over shared memory (`BarrierExchange`), and the block reduction of the row kernels
(`BlockReduce`), in the fixed form and in the form that hung on the H200 (`warp_idx_in_branch`:
`cute.arch.warp_idx()` inside `if lane == 0:` emits a full-mask `shfl.sync` that lanes 1..31
never join, while they wait at the barrier for lane 0).

All take raw addresses (Int64) and a `CUstream`, like the real kernels, so they compile without
a GPU (`compile_probe`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

try:
    from cutlass.memory import SmemAllocator as _SmemAllocator
except ImportError:  # pragma: no cover
    from cutlass.utils import SmemAllocator as _SmemAllocator

__all__ = ["WriteOne", "BarrierExchange", "BlockReduce", "compile_probe", "PROBES"]


def _int32_at(addr: Int64, index):
    ptr = cute.make_ptr(Int32, addr + Int64(index) * 4, cute.AddressSpace.gmem, assumed_align=4)
    return cute.make_tensor(ptr, cute.make_layout((1,)))


def _f32_at(addr: Int64, index):
    ptr = cute.make_ptr(Float32, addr + Int64(index) * 4, cute.AddressSpace.gmem, assumed_align=4)
    return cute.make_tensor(ptr, cute.make_layout((1,)))


class WriteOne:
    """Thread 0 of one 32-thread CTA writes `value` to the int32 at `out`."""

    threads = 32

    @cute.jit
    def __call__(self, out: Int64, value: Int32, stream: cuda.CUstream):
        self.kernel(out, value).launch(grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: Int64, value: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            dst = _int32_at(out, 0)
            dst[0] = value


class BarrierExchange:
    """128 threads: each stores 3 * tid in shared memory, one CTA barrier, then thread t writes
    the value of thread (t + 1) % 128 to out[t] (int32). Expect out[t] = 3 * ((t + 1) % 128)."""

    threads = 128

    @cute.jit
    def __call__(self, out: Int64, value: Int32, stream: cuda.CUstream):
        self.kernel(out, value).launch(grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: Int64, value: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = _SmemAllocator()
        buf = smem.allocate_tensor(Int32, cute.make_layout((self.threads,)), byte_alignment=16)
        buf[tidx] = tidx * value
        cute.arch.sync_threads()
        dst = _int32_at(out, tidx)
        dst[0] = buf[(tidx + 1) % self.threads]


class BlockReduce:
    """128 threads (4 warps) sum `value` over the CTA the way the row kernels do: warp shuffle
    reduction, lane 0 of each warp stores its warp's sum, barrier, every thread adds the 4 sums
    and writes them to out[t] (fp32). Expect 128 * value everywhere.

    `warp_idx_in_branch=True` is the form that hung on the H200 (never use it outside the probe)."""

    threads = 128

    def __init__(self, warp_idx_in_branch: bool = False):
        self.warp_idx_in_branch = warp_idx_in_branch

    @cute.jit
    def __call__(self, out: Int64, value: Int32, stream: cuda.CUstream):
        self.kernel(out, value).launch(grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: Int64, value: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = _SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.threads // 32,)), byte_alignment=16)
        v = cute.arch.warp_reduction_sum(Float32(value))
        if const_expr(self.warp_idx_in_branch):
            if cute.arch.lane_idx() == 0:
                red[cute.arch.warp_idx()] = v
        else:
            if tidx % 32 == 0:
                red[tidx // 32] = v
        cute.arch.sync_threads()
        total = red[0]
        for w in cutlass.range_constexpr(1, self.threads // 32):
            total = total + red[w]
        dst = _f32_at(out, tidx)
        dst[0] = total


#: name -> (kernel factory, threads, output dtype name, expected values as a function of (value, threads))
PROBES = {
    "write_one": (WriteOne, 32, "int32", lambda value, n: [value]),
    "barrier_exchange": (BarrierExchange, 128, "int32", lambda value, n: [value * ((t + 1) % n) for t in range(n)]),
    "block_reduce": (BlockReduce, 128, "float32", lambda value, n: [float(value * n)] * n),
    "block_reduce_warp_idx_in_branch": (lambda: BlockReduce(True), 128, "float32", lambda value, n: [float(value * n)] * n),
}


def compile_probe(name: str, arch: str, *, keep_ptx_dir=None):
    """Compile probe `name` for `arch` (no GPU needed)."""
    factory = PROBES[name][0]
    options = f"--gpu-arch {arch}"
    if keep_ptx_dir:
        import os

        os.makedirs(keep_ptx_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {keep_ptx_dir}"
    return cute.compile(factory(), Int64(0), Int32(1), cuda.CUstream(0), options=options)


class WriteOneTensor:
    """The DSL's own calling convention (a `cute.Tensor` from `from_dlpack`, the arch read off the
    device): thread 0 writes `value` to t[0]. The baseline that involves none of our plumbing."""

    @cute.jit
    def __call__(self, t: cute.Tensor, value: Int32, stream: cuda.CUstream):
        self.kernel(t, value).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, t: cute.Tensor, value: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            t[0] = value
