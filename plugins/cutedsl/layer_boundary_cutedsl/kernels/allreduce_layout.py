"""The one-shot all-reduce kernels' variants and the layout of their peer buffers (pure Python).

Every rank of a group owns one peer-mapped buffer, laid out as

    offset 0                 flags   int64 [world, capacity]   flags[src, row]: the last call (epoch)
                                                               in which rank `src` published `row`
    offset staging_offset    staging [2, capacity, row_stride] this rank's partial rows, double-
                                                               buffered by the parity of the epoch

and a local (not shared) int64 state `[completed calls, CTAs arrived, timeout ns, spare]`.
Peers write only the flags (each rank writes its own `src` slot of every peer's flags) and read
only the staging rows. The layout depends on (world, capacity, hidden, dtype): the same on
every rank of a group, which the workspace checks when it exchanges the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .tiling import MAX_TOP_K, SUPPORTED_DTYPES, _DTYPE_NAMES, RowTiling, check_hidden, row_tiling

if TYPE_CHECKING:
    from .norms import NormsShape

__all__ = [
    "WORLD_SIZES",
    "N_ADDRESSES",
    "ENTRY_KINDS",
    "NORMS_N_ADDRESSES",
    "NORMS_ENTRY_KINDS",
    "AllReduceNormsVariant",
    "all_allreduce_norms_variants",
    "MAX_WORLD",
    "FLAG_BYTES",
    "STATE_WORDS",
    "DIAG_WORDS",
    "AllReduceVariant",
    "BufferLayout",
    "buffer_layout",
    "all_allreduce_variants",
]

#: group sizes the kernels are compiled for (the flag and sum loops are unrolled per size)
WORLD_SIZES = (2, 4, 8)
MAX_WORLD = 8
FLAG_BYTES = 8  # one int64 epoch per (source rank, row)
#: address arguments of the kernel entry: src, weights, shared, residual, gamma, residual_out,
#: out, state, diag, own buffer, then MAX_WORLD peer buffers by rank (unused ones 0); then the
#: scalars rows, rank, capacity, eps, grid and the stream
N_ADDRESSES = 10 + MAX_WORLD
ENTRY_KINDS = ("i64",) * N_ADDRESSES + ("i32", "i32", "i32", "f32", "i32", "stream")
#: the norms variant's entry: the same addresses, then beta and post_gamma; rows, rank, capacity,
#: eps, post_eps, grid, stream
NORMS_N_ADDRESSES = N_ADDRESSES + 2
NORMS_ENTRY_KINDS = ("i64",) * NORMS_N_ADDRESSES + ("i32", "i32", "i32", "f32", "f32", "i32", "stream")
#: the local state words: [0] completed calls (the epoch of the last call), [1] CTAs of the
#: running call that have finished, [2] the spin timeout in ns, [3] spare
STATE_WORDS = 4
#: host-visible words a timed-out CTA writes before it traps: [0] 1, [1] rank, [2] peer,
#: [3] row, [4] epoch awaited, [5] flag value seen, [6] ns waited
DIAG_WORDS = 8
_ALIGN = 256  # the staging area starts on a 256-byte boundary
_ROW_ALIGN = 128  # each staging row starts on its own 128-byte line (no line holds two rows)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class AllReduceVariant:
    """One compiled one-shot all-reduce + residual add + RMSNorm kernel.

    `top_k == 0`: the partial is a [T, H] tensor of this rank; `top_k >= 1`: the partial is the
    MoE finalize of dense expert rows `[T, top_k, H]` with fp32 weights `[T, top_k]` (plus a
    shared-expert partial `[T, H]` with `shared`), computed in fp32 and rounded once before
    the exchange. The norm multiplier is `gamma + weight_offset` (1.0: Gemma)."""

    dtype: torch.dtype
    hidden: int
    world: int
    weight_offset: float = 0.0
    top_k: int = 0
    shared: bool = False

    def __post_init__(self):
        check_hidden(self.hidden, self.dtype)
        if self.world not in WORLD_SIZES:
            raise ValueError(f"the one-shot all-reduce is compiled for groups of {WORLD_SIZES} ranks, got {self.world}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k {self.top_k} must be in 0..{MAX_TOP_K} (0: no MoE finalize)")
        if self.shared and not self.top_k:
            raise ValueError("a shared-expert partial needs the MoE finalize variant (top_k >= 1)")

    @property
    def moe(self) -> bool:
        return self.top_k > 0

    def tiling(self) -> RowTiling:
        # `world` peer rows (or top_k expert rows) per vector slot are in flight at once
        return row_tiling(self.hidden, self.dtype, max_vpt=2, min_threads=128)

    @property
    def ebytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_stride(self) -> int:
        return _round_up(self.hidden * self.ebytes, _ROW_ALIGN)

    @property
    def name(self) -> str:
        parts = ["allreduce" + (f"_moe_k{self.top_k}" if self.moe else ""), "add_rmsnorm", _DTYPE_NAMES[self.dtype], f"h{self.hidden}", f"w{self.world}"]
        if self.shared:
            parts.append("shared")
        if self.weight_offset:
            parts.append("gemma")
        return "_".join(parts)

    # compiler hooks (compiler.py): the kernel object and example arguments, imported lazily
    def kernel_object(self):
        from .allreduce_dsl import AllReduceAddRMSNormKernel

        return AllReduceAddRMSNormKernel(self)

    def example_args(self) -> list:
        import cuda.bindings.driver as cuda
        from cutlass import Float32, Int32, Int64

        return [Int64(0)] * N_ADDRESSES + [Int32(1), Int32(0), Int32(1), Float32(1e-6), Int32(1), cuda.CUstream(0)]


@dataclass(frozen=True)
class AllReduceNormsVariant(AllReduceVariant):
    """The one-shot all-reduce with the norms of a `NormsShape` around the add (kernels/norms.py):
    the group's sum rounded once to the row dtype, its RMS post-norm (rounded), the residual add,
    the read's RMSNorm, LayerNorm or nothing; or, without a post-norm, the sum + residual into a
    LayerNorm or an identity read. This rank's partial is a [T, H] tensor (no MoE finalize)."""

    shape: Optional["NormsShape"] = None

    def __post_init__(self):
        super().__post_init__()
        if self.top_k:
            raise ValueError("the norms variant takes a [T, H] partial, not a MoE finalize")
        if self.shape is None or (self.shape.norm == "rms" and not self.shape.post):
            raise ValueError("a norms variant needs a post-norm or a read other than RMSNorm (AllReduceVariant runs add + RMSNorm)")
        if self.weight_offset != self.shape.weight_offset:
            raise ValueError("weight_offset is the shape's")

    @property
    def name(self) -> str:
        return f"allreduce_{self.shape.tag}_{_DTYPE_NAMES[self.dtype]}_h{self.hidden}_w{self.world}"

    def kernel_object(self):
        from .allreduce_dsl import AllReduceNormsKernel

        return AllReduceNormsKernel(self)

    def example_args(self) -> list:
        import cuda.bindings.driver as cuda
        from cutlass import Float32, Int32, Int64

        return [Int64(0)] * NORMS_N_ADDRESSES + [Int32(1), Int32(0), Int32(1), Float32(1e-6), Float32(1e-6), Int32(1), cuda.CUstream(0)]

    @classmethod
    def of(cls, dtype, hidden: int, world: int, shape) -> "AllReduceNormsVariant":
        return cls(dtype, hidden, world, float(shape.weight_offset), shape=shape)


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets inside one rank's peer buffer."""

    world: int
    capacity: int  # rows per staging parity
    row_stride: int  # bytes per staging row

    @property
    def flags_bytes(self) -> int:
        return self.world * self.capacity * FLAG_BYTES

    @property
    def staging_offset(self) -> int:
        return _round_up(self.flags_bytes, _ALIGN)

    @property
    def nbytes(self) -> int:
        return self.staging_offset + 2 * self.capacity * self.row_stride

    def flag_offset(self, src: int, row: int) -> int:
        return (src * self.capacity + row) * FLAG_BYTES

    def staging_row_offset(self, parity: int, row: int) -> int:
        return self.staging_offset + (parity * self.capacity + row) * self.row_stride


def buffer_layout(world: int, capacity: int, hidden: int, dtype: torch.dtype) -> BufferLayout:
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    ebytes = torch.empty((), dtype=dtype).element_size()
    return BufferLayout(world, capacity, _round_up(hidden * ebytes, _ROW_ALIGN))


def all_allreduce_variants() -> list:
    """The variants the CPU compile test builds: every dtype x world x norm for the plain
    kernel at one width, widths that need bounds checks or more warps, and the MoE kernel."""
    out = []
    for dtype in SUPPORTED_DTYPES:
        for world in WORLD_SIZES:
            for offset in (0.0, 1.0):
                out.append(AllReduceVariant(dtype, 4096, world, offset))
    for hidden in (1024, 2880, 8192):
        out.append(AllReduceVariant(torch.bfloat16, hidden, 2))
    for world in WORLD_SIZES:
        for shared in (False, True):
            out.append(AllReduceVariant(torch.bfloat16, 4096, world, 0.0, top_k=8, shared=shared))
    out.append(AllReduceVariant(torch.float16, 4096, 2, 1.0, top_k=8, shared=True))
    out.append(AllReduceVariant(torch.bfloat16, 2880, 4, 1.0, top_k=1))
    return out


def all_allreduce_norms_variants() -> list:
    """The norms variants the CPU compile test builds: each shape the plugin takes at 2 ranks on
    a width without bounds checks, one with them at 4 ranks, fp16 once, 8 ranks once."""
    from .norms import NormsShape

    shapes = [NormsShape("rms", 1.0, post=True, post_offset=1.0), NormsShape("none", post=True), NormsShape("rms", post=True),
              NormsShape("layer", bias=True), NormsShape("layer")]
    out = [AllReduceNormsVariant.of(torch.bfloat16, 4096, 2, shape) for shape in shapes]
    out += [AllReduceNormsVariant.of(torch.bfloat16, 2880, 4, shape) for shape in (shapes[0], shapes[3])]
    out.append(AllReduceNormsVariant.of(torch.float16, 2048, 8, shapes[1]))
    return out
