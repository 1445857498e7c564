"""`fused_add_norms`: a residual add between norms other than one RMSNorm, in one CuTe DSL launch
(torch-facing wrapper; the kernel is norms_dsl.py): an RMSNorm post-norm of the output before the
add (Gemma 2/3's sandwich, OLMo-2's post-norm), and a LayerNorm read (GPT-NeoX, Cohere).

Per row, all in fp32 from one read of x and the residual:

1. with a post-norm: `x = round(x * rsqrt(mean(x^2) + post_eps) * (post_gamma + post_offset))`,
   rounded once to the row dtype (what the unfused path hands on);
2. `total = x + residual`, rounded once into the new residual;
3. the read's norm of the unrounded total: "rms" (`total * rstd * (gamma + weight_offset)`),
   "layer" (`(total - mean) * rsqrt(var + eps) * gamma (+ beta)`, the variance of the centered
   row), or "none" (an identity read: the compute input is the new residual).

Every output is rounded once. `NormsShape` says which of these a kernel computes; pure Python
here (no cutlass), so shapes and variants can be listed and tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._launch import check_rows, executor_for, launch_args, rows_ok
from .tiling import _DTYPE_NAMES, check_hidden, row_tiling

__all__ = ["NORM_KINDS", "NormsShape", "NormsVariant", "fused_add_norms", "prepare_add_norms", "all_norms_variants", "ENTRY_KINDS"]

#: the read norms a kernel computes after the add
NORM_KINDS = ("rms", "layer", "none")
#: the entry's arguments: x, residual, gamma, beta, post_gamma, residual_out, out, then rows, eps,
#: post_eps, grid and the stream
N_ADDRESSES = 7
ENTRY_KINDS = ("i64",) * N_ADDRESSES + ("i32", "f32", "f32", "i32", "stream")
PROBE = (*range(0x1000, 0x1000 + 16 * N_ADDRESSES, 16), 7, 0.5, 0.25, 3, 0x5150)


@dataclass(frozen=True)
class NormsShape:
    """What a kernel computes around the add: `post` (an RMSNorm post-norm of x with multiplier
    `post_gamma + post_offset`), then the read's `norm` (`NORM_KINDS`) with multiplier
    `gamma + weight_offset` and, for a LayerNorm, `bias`."""

    norm: str = "rms"
    weight_offset: float = 0.0
    bias: bool = False
    post: bool = False
    post_offset: float = 0.0

    def __post_init__(self):
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {NORM_KINDS}, got {self.norm!r}")
        if self.bias and self.norm != "layer":
            raise ValueError("a bias belongs to a LayerNorm read (norm='layer')")
        if self.norm == "none" and not self.post:
            raise ValueError("an identity read with no post-norm is a plain add: nothing for a norm kernel to do")
        if self.norm == "layer" and self.weight_offset:
            raise ValueError("a LayerNorm's weight has no offset")
        if not self.post and self.post_offset:
            raise ValueError("post_offset belongs to a post-norm (post=True)")

    @property
    def tag(self) -> str:
        post = f"post{'_gemma' if self.post_offset else ''}_" if self.post else ""
        read = {"rms": "rmsnorm", "layer": "layernorm", "none": "identity"}[self.norm]
        return f"{post}add_{read}{'_gemma' if self.weight_offset else ''}{'_bias' if self.bias else ''}"


@dataclass(frozen=True)
class NormsVariant:
    """One compiled local kernel: `shape` on rows of `hidden` `dtype` values, a PDL launch."""

    dtype: torch.dtype
    hidden: int
    shape: NormsShape = NormsShape()
    pdl: bool = True

    def __post_init__(self):
        check_hidden(self.hidden, self.dtype)

    def tiling(self):
        return row_tiling(self.hidden, self.dtype, max_vpt=4, min_threads=128)

    @property
    def name(self) -> str:
        return f"{self.shape.tag}_{_DTYPE_NAMES[self.dtype]}_h{self.hidden}{'' if self.pdl else '_nopdl'}"

    def kernel_object(self):
        from .norms_dsl import AddNormsKernel

        return AddNormsKernel(self)

    def example_args(self) -> list:
        import cuda.bindings.driver as cuda
        from cutlass import Float32, Int32, Int64

        return [Int64(0)] * N_ADDRESSES + [Int32(1), Float32(1e-6), Float32(1e-6), Int32(1), cuda.CUstream(0)]


_entries: dict = {}


def _entry(variant: NormsVariant, device: torch.device):
    entry = _entries.get((variant, device))
    if entry is None:
        entry = _entries[(variant, device)] = executor_for(("norms", variant), device, lambda: variant, N_ADDRESSES, kinds=ENTRY_KINDS,
                                                           probe=PROBE)
    return entry


def prepare_add_norms(dtype: torch.dtype, hidden: int, shapes, device=None) -> None:
    """Compile and load the kernels of `shapes` now (before a CUDA-graph capture, at model load)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    for shape in shapes:
        _entry(NormsVariant(dtype, hidden, shape), device)


def fused_add_norms(
    x: torch.Tensor,
    residual: torch.Tensor,
    gamma: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    post_gamma: Optional[torch.Tensor],
    eps: float,
    post_eps: float,
    shape: NormsShape,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
):
    """(normed, new_residual) of `shape` (see the module doc): x, residual [T, H] bf16/fp16 CUDA
    rows back to back, 16-byte aligned; gamma, beta, post_gamma [H] of the same dtype (None where
    the shape has none). An identity read returns the new residual twice. Outputs default to new
    tensors."""
    hidden = x.shape[-1]
    rows_shape, dtype, device = x.shape, x.dtype, x.device
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    identity = shape.norm == "none"
    if not identity:
        out = torch.empty_like(x) if out is None else out
    named = dict(x=x, residual=residual, residual_out=residual_out, out=out)
    weights = dict(gamma=gamma if not identity else None, beta=beta if shape.bias else None, post_gamma=post_gamma if shape.post else None)
    wanted = {"gamma": not identity, "beta": shape.bias, "post_gamma": shape.post}
    missing = [k for k, need in wanted.items() if need and weights[k] is None]
    if missing:
        raise ValueError(f"{shape.tag} needs {', '.join(missing)}")
    if not (all(t is None or rows_ok(t, rows_shape, dtype, device) for t in named.values())
            and all(t is None or rows_ok(t, (hidden,), dtype, device) for t in weights.values())):
        check_hidden(hidden, dtype)
        check_rows(dtype, device, rows_shape, **named)
        check_rows(dtype, device, (hidden,), **{k: v for k, v in weights.items()})
    rows = x.numel() // hidden if hidden else 0
    if rows:  # two empty tensors may share an address (no storage): only rows written can overlap
        if out is not None and out.data_ptr() == residual_out.data_ptr():
            raise ValueError("out and residual_out must not be the same memory")
        entry = _entry(NormsVariant(dtype, hidden, shape), device)
        addresses = [t.data_ptr() if t is not None else 0 for t in (x, residual, weights["gamma"], weights["beta"], weights["post_gamma"],
                                                                  residual_out, out)]
        launch_args(entry, rows, (*addresses, rows, float(eps), float(post_eps)), device)
    return (residual_out if identity else out), residual_out


def all_norms_variants(hidden_sizes=(4096, 2880), dtypes=(torch.bfloat16,)) -> list:
    """The variants the CPU compile test builds: every shape the plugin takes (Gemma's sandwich,
    OLMo-2's post-norm before an identity read, a post-norm before a plain RMSNorm, LayerNorm with
    and without a bias), on a width without bounds checks and one with them; fp16 once."""
    shapes = [
        NormsShape("rms", 1.0, post=True, post_offset=1.0),
        NormsShape("none", post=True),
        NormsShape("rms", post=True),
        NormsShape("layer", bias=True),
        NormsShape("layer"),
    ]
    out = [NormsVariant(dtype, hidden, shape) for dtype in dtypes for hidden in hidden_sizes for shape in shapes]
    out.append(NormsVariant(torch.float16, 2048, NormsShape("layer", bias=True)))
    return out
