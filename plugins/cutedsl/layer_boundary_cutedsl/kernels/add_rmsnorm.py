"""`fused_add_rmsnorm`: residual add + RMSNorm in one CuTe DSL kernel (torch-facing wrapper).

Same semantics as the core's `add_rms_norm` for an RMSNorm: the sum in fp32, rounded once into
the new residual; the norm reads the unrounded sum and is rounded once after the gamma multiply.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import check_rows, executor_for, launch, rows_ok
from .tiling import AUTO, ROWS_BANDS, AddNormVariant, check_hidden, parse_candidate, pick_band

__all__ = ["fused_add_rmsnorm", "prepare_add_rmsnorm"]

_entries: dict = {}  # ((variant key), device) -> launcher entry, the per-call lookup


#: `fused_add_rmsnorm`'s kernel options, in the order of its variant keys (AddNormVariant fields)
KERNEL_OPTIONS = ("pdl", "layout", "staged", "late_trigger", "reread", "ctas_per_sm", "late_gamma", "l1_staging", "no_loop")
_DEFAULT_OPTIONS = (True, None, False, False, False, 0, False, False, False)


def _options_tuple(options: dict) -> tuple:
    full = dict(zip(KERNEL_OPTIONS, _DEFAULT_OPTIONS))
    full.update(options)
    return tuple(full[k] for k in KERNEL_OPTIONS)


def parse_bands(bands: dict) -> dict:
    """hidden -> ((first rows, end rows, options tuple), ...) of a `ROWS_BANDS`-shaped table."""
    return {h: tuple((first, end, _options_tuple(parse_candidate(name))) for first, end, name in rows) for h, rows in bands.items()}


#: `ROWS_BANDS` parsed once (tests put their own table here)
_BANDS = parse_bands(ROWS_BANDS)


def _entry(dtype, hidden, weight_offset, device, options: tuple = _DEFAULT_OPTIONS):
    """The launcher of the kernel with `options` (values in `KERNEL_OPTIONS` order)."""
    key = ("add_rmsnorm", dtype, hidden, weight_offset) + options
    return executor_for(key, device, lambda: AddNormVariant(dtype, hidden, weight_offset, **dict(zip(KERNEL_OPTIONS, options))), 5)


def prepare_add_rmsnorm(dtype: torch.dtype, hidden: int, *, weight_offset: float = 0.0, device=None) -> None:
    """Compile and load the kernels a plain call may run (each token count's: `ROWS_BANDS`) now,
    before a CUDA graph capture or at model load."""
    check_hidden(hidden, dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    for options in {_DEFAULT_OPTIONS, *(options for _, _, options in _BANDS.get(hidden, ()))}:
        _entry(dtype, hidden, float(weight_offset), device, options)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    out: Optional[torch.Tensor] = None,
    *,
    residual_out: Optional[torch.Tensor] = None,
    weight_offset: float = 0.0,
    pdl: bool = True,
    layout=AUTO,
    staged: bool = False,
    late_trigger: bool = False,
    reread: bool = False,
    ctas_per_sm: int = 0,
    late_gamma: bool = False,
    l1_staging: bool = False,
    no_loop: bool = False,
):
    """(normed, new_residual) with new_residual = x + residual and
    normed = new_residual_fp32 * rsqrt(mean(new_residual_fp32^2) + eps) * (gamma + weight_offset).

    x, residual: [..., H] bf16/fp16 CUDA tensors, rows back to back; gamma: [H], same dtype.
    `weight_offset=1.0` is the Gemma `(1 + w)` norm (gamma is then the raw w); passing the
    already applied multiplier (`RMSNorm.gemma_weight`) with offset 0 is equally valid.
    `out` / `residual_out` default to new tensors; `residual_out=residual` updates the residual
    in place and `out=x` overwrites x (out and residual_out must not be the same memory).
    The kernel options are for benchmarks. Left alone (`layout=AUTO`), the kernel is chosen by
    the token count (`tiling.ROWS_BANDS`: measured bands of each width, the default tiling
    elsewhere); any option given runs exactly that kernel, `layout=None` being the default tiling.
    `pdl=False` launches the kernel as an ordinary one (benchmarks compare the two);
    `layout=(threads per row, rows per CTA)` overrides the width's tiling and `staged=True` loads
    through shared memory (cp.async): docs/kernels.md compares them. `late_trigger=True` (PDL)
    lets the next kernel launch at the end instead of at the start (with `no_loop`, what the bands
    run: an early trigger lets the next launch's CTAs hold SM slots while they wait).
    `reread=True` (with `staged`) keeps the staged row in shared
    memory and sums it again for the norm instead of holding it in registers; `ctas_per_sm=N`
    caps the registers so that N CTAs fit an SM; `late_gamma=True` reads gamma per row after
    the PDL wait and keeps it 16-bit until the norm; `l1_staging=True` (with `staged`) lets the
    staged copies allocate in L1; `no_loop=True` gives each block of rows its own CTA with no
    grid-stride loop.
    """
    hidden = x.shape[-1]
    shape, dtype, device = x.shape, x.dtype, x.device
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    if not (
        rows_ok(x, shape, dtype, device)
        and rows_ok(residual, shape, dtype, device)
        and rows_ok(out, shape, dtype, device)
        and rows_ok(residual_out, shape, dtype, device)
        and rows_ok(gamma, (hidden,), dtype, device)
    ):
        check_hidden(hidden, dtype)
        check_rows(dtype, device, shape, x=x, residual=residual, out=out, residual_out=residual_out, gamma=gamma)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return out, residual_out
    if layout == AUTO and pdl and not (staged or late_trigger or reread or ctas_per_sm or late_gamma or l1_staging or no_loop):
        # a plain call: the kernel `tiling.rows_kernel` names for this token count
        bands = _BANDS.get(hidden)
        options = _DEFAULT_OPTIONS if bands is None else pick_band(bands, rows, _DEFAULT_OPTIONS)
    else:
        options = (pdl, None if layout == AUTO else layout, staged, late_trigger, reread, ctas_per_sm, late_gamma, l1_staging, no_loop)
    key = ("add_rmsnorm", dtype, hidden, weight_offset, options)
    entry = _entries.get((key, device))
    if entry is None:
        check_hidden(hidden, dtype)
        if out.data_ptr() == residual_out.data_ptr():
            raise ValueError("out and residual_out must not be the same memory")
        if isinstance(options[1], str):
            raise ValueError(f"layout must be AUTO ({AUTO!r}), None or (threads per row, rows per CTA), got {options[1]!r}")
        # each option as its default's type (bool flags, int ctas_per_sm); the layout as given
        options = tuple(v if default is None else type(default)(v) for v, default in zip(options, _DEFAULT_OPTIONS))
        entry = _entries[(key, device)] = _entry(dtype, hidden, float(weight_offset), device, options)
    elif out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must not be the same memory")
    launch(entry, rows, [x.data_ptr(), residual.data_ptr(), gamma.data_ptr(), residual_out.data_ptr(), out.data_ptr()], eps, device)
    return out, residual_out
