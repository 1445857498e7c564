"""act(gate) * up of a gated MLP in CuTe DSL (imports cutlass: load lazily).

The input row [2 * d] holds the gate then the up projection; every thread takes one 16-byte
vector (8 elements) of the gate, the matching one of up, and writes one vector of the output
(fp32 math, rounded once). The grid covers the rows' vectors flat (tokens x d / 8 of them, 128
threads a CTA), so one token's row is spread over d / 1024 CTAs: FlashInfer's `silu_and_mul`
gives each token one CTA, which leaves most SMs idle at decode batch sizes.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .dsl_rows import cutlass_dtype, gmem_vector, launch_indices, vector_atom

__all__ = ["GatedActivationKernel"]

ELEMS = 8
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


class GatedActivationKernel:
    """Arguments: gate_up [T, 2 * d] and out [T, d] (contiguous, 16-byte aligned), the vector
    count T * d / 8, `grid` CTAs (grid-stride over the vectors)."""

    def __init__(self, variant):
        self.dtype = cutlass_dtype(variant.dtype)
        self.ebytes = 2
        self.width = variant.intermediate
        self.row_vectors = variant.intermediate // ELEMS
        self.activation = variant.activation
        self.cta_threads = variant.cta_threads
        self.pdl = bool(variant.pdl)

    @cute.jit
    def __call__(self, gate_up: Int64, out: Int64, vectors: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(gate_up, out, vectors).launch(grid=[grid, 1, 1], block=[self.cta_threads, 1, 1], stream=stream, use_pdl=self.pdl)

    def _vector(self, addr: Int64):
        return gmem_vector(self.dtype, addr, ELEMS)

    @cute.jit
    def _act(self, g):
        if const_expr(self.activation == "silu"):
            result = g / (Float32(1.0) + cute.math.exp(-g, fastmath=True))
        elif const_expr(self.activation == "gelu_tanh"):
            inner = Float32(_SQRT_2_OVER_PI) * (g + Float32(0.044715) * g * g * g)
            result = Float32(0.5) * g * (Float32(1.0) + cute.math.tanh(inner))
        else:  # gelu (erf)
            result = Float32(0.5) * g * (Float32(1.0) + cute.math.erf(g * Float32(_INV_SQRT_2)))
        return result

    @cute.kernel
    def kernel(self, gate_up: Int64, out: Int64, vectors: Int32):
        tidx, bidx, gdim = launch_indices()
        atom = vector_atom(self.dtype)
        if const_expr(self.pdl):
            # gate_up comes from the GEMM before: wait for it, then let the next kernel prologue
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        for v in cutlass.range(bidx * self.cta_threads + tidx, vectors, gdim * self.cta_threads):
            token = v // self.row_vectors
            col = (v - token * self.row_vectors) * ELEMS
            gate_at = gate_up + (Int64(token) * (2 * self.width) + col) * self.ebytes
            gfrag = cute.make_rmem_tensor((ELEMS,), self.dtype)
            ufrag = cute.make_rmem_tensor((ELEMS,), self.dtype)
            cute.copy(atom, self._vector(gate_at), gfrag)
            cute.copy(atom, self._vector(gate_at + self.width * self.ebytes), ufrag)
            result = self._act(gfrag.load().to(Float32)) * ufrag.load().to(Float32)
            ofrag = cute.make_rmem_tensor((ELEMS,), self.dtype)
            ofrag.store(result.to(self.dtype))
            cute.copy(atom, ofrag, self._vector(out + (Int64(token) * self.width + col) * self.ebytes))
