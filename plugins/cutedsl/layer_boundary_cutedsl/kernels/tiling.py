"""How a row of `hidden` elements is spread over a CTA, and the keys of compiled variants.

Pure Python (no cutlass, no CUDA) so that the choices can be tested and listed on any machine.

Every kernel here works on rows of `hidden` elements moved as 16-byte vectors (8 bf16/fp16
values). A CTA owns `rows_per_cta` rows at a time (one row for most kernels; the kernels also
loop over rows when given fewer CTAs); each row's `threads` threads hold `vpt` vectors of it in
registers, so the row is read from HBM once, reduced with warp shuffles (plus one shared-memory
exchange when a row spans several warps), and written once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = [
    "VEC_BYTES",
    "SUPPORTED_DTYPES",
    "TESTED_HIDDEN_SIZES",
    "MAX_HIDDEN",
    "RowTiling",
    "row_tiling",
    "group_tiling",
    "AddNormVariant",
    "MoeVariant",
    "check_hidden",
    "TESTED_TOP_K",
    "MAX_TOP_K",
    "default_grid",
    "all_add_norm_variants",
    "all_moe_variants",
    "AUTO",
    "ROWS_BANDS",
    "SHIPPED_ROWS_BANDS",
    "ROWS_BANDS_ENV",
    "check_bands",
    "load_bands",
    "rows_kernel",
    "pick_band",
    "parse_candidate",
]

VEC_BYTES = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: hidden sizes the compile test covers (Llama/Qwen/Mixtral/DeepSeek/gpt-oss widths); any
#: multiple of 8 up to MAX_HIDDEN compiles on demand
TESTED_HIDDEN_SIZES = (1024, 2048, 2880, 3072, 4096, 5120, 6144, 7168, 8192)
MAX_HIDDEN = 16384
#: top_k values the compile test covers for the MoE kernels
TESTED_TOP_K = (1, 2, 4, 6, 8)
MAX_TOP_K = 16


def _elems_per_vec(dtype: torch.dtype) -> int:
    return VEC_BYTES // torch.empty((), dtype=dtype).element_size()


def check_hidden(hidden: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ValueError unless rows of `hidden` elements split into whole 16-byte vectors."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cutedsl kernels take bf16 or fp16 rows, got {dtype}")
    vec = _elems_per_vec(dtype)
    if hidden <= 0 or hidden % vec or hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} must be a positive multiple of {vec} and at most {MAX_HIDDEN}")


@dataclass(frozen=True)
class RowTiling:
    """`threads` threads per row, each holding `vpt` vectors of `vec` elements of it, and
    `rows_per_cta` rows side by side in a CTA of `cta_threads` threads.

    `full` is True when threads * vpt * vec == hidden exactly, so no vector needs a bounds check.
    """

    hidden: int
    vec: int
    threads: int
    vpt: int
    rows_per_cta: int = 1

    @property
    def cta_threads(self) -> int:
        return self.threads * self.rows_per_cta

    @property
    def nvec(self) -> int:
        return self.hidden // self.vec

    @property
    def full(self) -> bool:
        return self.threads * self.vpt == self.nvec

    @property
    def warps(self) -> int:
        return self.threads // 32


def row_tiling(hidden: int, dtype: torch.dtype = torch.bfloat16, *, max_vpt: int = 4, min_threads: int = 128) -> RowTiling:
    """Up to `max_vpt` vectors per thread (more bytes in flight per thread), but at least
    `min_threads` threads per CTA when the row is long enough (fewer, bigger CTAs keep the
    barrier count per byte low; too few threads leave an SM idle at small token counts).

    bf16, max_vpt=4: 1024 -> 128x1, 2048 -> 128x2, 4096 -> 128x4, 7168 -> 224x4, 8192 -> 256x4.
    """
    check_hidden(hidden, dtype)
    vec = _elems_per_vec(dtype)
    nvec = hidden // vec
    vpt = max(1, min(max_vpt, nvec // min_threads))
    threads = -(-nvec // vpt)
    threads = -(-threads // 32) * 32
    if threads > 1024:
        raise ValueError(f"hidden size {hidden} needs {threads} threads per CTA (max 1024)")
    return RowTiling(hidden=hidden, vec=vec, threads=threads, vpt=vpt)


def group_tiling(hidden: int, dtype: torch.dtype, threads_per_row: int, rows_per_cta: int) -> RowTiling:
    """`rows_per_cta` rows a CTA, each spread over `threads_per_row` threads (a multiple of 32,
    so that no warp holds two rows and a one-warp row reduces with shuffles alone)."""
    check_hidden(hidden, dtype)
    if threads_per_row <= 0 or threads_per_row % 32 or rows_per_cta <= 0 or threads_per_row * rows_per_cta > 1024:
        raise ValueError(
            f"a row layout needs a positive multiple of 32 threads per row and at most 1024 threads a CTA, "
            f"got {threads_per_row} x {rows_per_cta}"
        )
    vec = _elems_per_vec(dtype)
    nvec = hidden // vec
    if threads_per_row > nvec:
        raise ValueError(f"{threads_per_row} threads a row leave threads idle: a {hidden}-wide row has {nvec} 16-byte vectors")
    vpt = -(-nvec // threads_per_row)
    return RowTiling(hidden=hidden, vec=vec, threads=threads_per_row, vpt=vpt, rows_per_cta=rows_per_cta)


#: shared memory a CTA may take without the opt-in attribute: the staged loads' limit
STAGING_MAX_BYTES = 48 * 1024

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class AddNormVariant:
    """One compiled residual add + RMSNorm kernel: gamma multiplier is `w + weight_offset`."""

    dtype: torch.dtype
    hidden: int
    weight_offset: float = 0.0  # 0.0: plain RMSNorm; 1.0: Gemma (1 + w)
    #: launched as a programmatic dependent (PDL): the CTAs start while the previous kernel on
    #: the stream drains, load gamma (a weight, never produced there), then wait for it
    pdl: bool = True
    #: (threads per row, rows per CTA); None: `row_tiling`'s one row of 128+ threads a CTA (no
    #: other layout is faster at any width: docs/kernels.md)
    layout: Optional[tuple] = None
    #: x and the residual come in through shared memory (cp.async, L2 only) instead of straight
    #: into registers (FlashInfer's norms load so)
    staged: bool = False
    #: with PDL, let the next kernel launch only when this one's CTAs are done with their rows
    #: (else at once, after the wait)
    late_trigger: bool = False
    #: (staged only) x and the residual stay in shared memory and are summed again for the norm
    #: pass, so no register holds the row across the reduction: several times the rows resident
    #: an SM, for token counts whose rows would not all fit at once otherwise
    reread: bool = False
    #: CTAs an SM must hold at once: the compiler caps the registers a thread to fit them, and
    #: shared memory gets the largest carveout (0: the compiler's own register count)
    ctas_per_sm: int = 0
    #: gamma read as loaded (16-bit) after the PDL wait, each row anew once its sum is stored,
    #: and widened only for the norm, instead of once as fp32 before the wait: half the
    #: registers gamma takes while a row's loads are in flight (FlashInfer's norms read it so)
    late_gamma: bool = False
    #: (staged only) the cp.async copies allocate in L1 (`.ca`) instead of going to shared
    #: memory from L2 alone (`.cg`), as FlashInfer's staged norms copy
    l1_staging: bool = False
    #: one block of rows a CTA and no grid-stride loop: the launch always gives every block its
    #: own CTA (`_launch.launch_args` never caps such a grid)
    no_loop: bool = False

    def __post_init__(self):
        if self.layout is not None and not (isinstance(self.layout, tuple) and len(self.layout) == 2):
            raise ValueError(f"a compiled kernel's layout is None or (threads per row, rows per CTA), got {self.layout!r}")
        if not 0 <= self.ctas_per_sm <= 32:
            raise ValueError(f"ctas_per_sm must be in 0..32 (an SM holds at most 32 CTAs), got {self.ctas_per_sm}")
        if self.reread and not self.staged:
            raise ValueError("reread=True reads the row back from shared memory: it needs staged=True")
        if self.l1_staging and not self.staged:
            raise ValueError("l1_staging=True chooses how the staged copies are cached: it needs staged=True")
        if self.staging_bytes > STAGING_MAX_BYTES:
            raise ValueError(
                f"staging two rows of {self.hidden} takes {self.staging_bytes} bytes of shared memory (at most {STAGING_MAX_BYTES})"
            )

    @property
    def staging_bytes(self) -> int:
        """Shared memory for the staged x and residual vectors of a CTA's rows (0 unstaged)."""
        if not self.staged:
            return 0
        t = self.tiling()
        return 2 * t.cta_threads * t.vpt * VEC_BYTES

    def tiling(self) -> RowTiling:
        if self.layout is None:
            return row_tiling(self.hidden, self.dtype, max_vpt=4, min_threads=128)
        return group_tiling(self.hidden, self.dtype, *self.layout)

    @property
    def name(self) -> str:
        g = "_gemma" if self.weight_offset else ""
        shape = f"_r{self.layout[0]}x{self.layout[1]}" if self.layout is not None else ""
        staged = ("_reread" if self.reread else "_staged") if self.staged else ""
        late = "_late" if self.late_trigger and self.pdl else ""
        occupancy = f"_o{self.ctas_per_sm}" if self.ctas_per_sm else ""
        gamma = "_lategamma" if self.late_gamma else ""
        l1 = "_l1" if self.l1_staging else ""
        loop = "_noloop" if self.no_loop else ""
        return (
            f"add_rmsnorm_{_DTYPE_NAMES[self.dtype]}_h{self.hidden}{g}{'' if self.pdl else '_nopdl'}{late}{shape}{staged}{l1}"
            f"{occupancy}{gamma}{loop}"
        )


@dataclass(frozen=True)
class MoeVariant:
    """One compiled MoE finalize kernel.

    `indexed`: routed rows are gathered through a permutation tensor (else row t*top_k + k);
    `shared`: a shared-expert output is added; `norm`: residual add + RMSNorm follow in the
    same pass (else the finalized sum is written, for a collective to run before the norm).
    """

    dtype: torch.dtype
    hidden: int
    top_k: int
    indexed: bool = True
    shared: bool = False
    norm: bool = True
    weight_offset: float = 0.0

    def __post_init__(self):
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k {self.top_k} must be in 1..{MAX_TOP_K}")
        if not self.norm and self.weight_offset:
            raise ValueError("weight_offset only applies to the norm variant")

    def tiling(self) -> RowTiling:
        # top_k rows per vector slot are in flight at once: fewer vectors per thread
        return row_tiling(self.hidden, self.dtype, max_vpt=2, min_threads=128)

    @property
    def name(self) -> str:
        parts = [
            "moe_finalize" + ("_add_rmsnorm" if self.norm else ""),
            _DTYPE_NAMES[self.dtype],
            f"h{self.hidden}",
            f"k{self.top_k}",
            "perm" if self.indexed else "dense",
        ]
        if self.shared:
            parts.append("shared")
        if self.weight_offset:
            parts.append("gemma")
        return "_".join(parts)


def all_add_norm_variants(hidden_sizes=TESTED_HIDDEN_SIZES, dtypes=SUPPORTED_DTYPES) -> Iterator[AddNormVariant]:
    for dtype in dtypes:
        for hidden in hidden_sizes:
            for offset in (0.0, 1.0):
                yield AddNormVariant(dtype, hidden, offset)


def all_moe_variants(
    hidden_sizes=TESTED_HIDDEN_SIZES, dtypes=SUPPORTED_DTYPES, top_ks=(8,), *, indexed_modes=(True, False)
) -> Iterator[MoeVariant]:
    """dtype x hidden x top_k x (gathered | dense rows) x shared x (norm plain | norm Gemma | no norm)."""
    for dtype in dtypes:
        for hidden in hidden_sizes:
            for top_k in top_ks:
                for indexed in indexed_modes:
                    for shared in (False, True):
                        for norm, offset in ((True, 0.0), (True, 1.0), (False, 0.0)):
                            yield MoeVariant(dtype, hidden, top_k, indexed, shared, norm, offset)


#: `fused_add_rmsnorm(layout=AUTO)`, its default: the kernel is chosen by the call's token count
AUTO = "auto"

#: a kernel name's on/off flags, in the order a name lists them -> `fused_add_rmsnorm` options
#: (+s staged, +l1 staged through L1, +late the late PDL trigger, +r re-read from shared memory,
#: then +oN N CTAs an SM, then +g gamma read late, +nl no grid-stride loop)
_FLAGS_BEFORE_O = (("s", "staged"), ("l1", "l1_staging"), ("late", "late_trigger"), ("r", "reread"))
_FLAGS_AFTER_O = (("g", "late_gamma"), ("nl", "no_loop"))


def parse_candidate(name: str) -> dict:
    """`fused_add_rmsnorm`'s options for a kernel name (ValueError for a malformed one): the
    layout (`default`, the width's `row_tiling`, or THREADSxROWS), then its flags
    (`_FLAGS_BEFORE_O`, `+oN`, `_FLAGS_AFTER_O`), e.g. `default`, `64x2+s+late`,
    `default+s+r+o8`, `128x1+s+l1+late+g+nl`. `auto` is the by-token-count choice (`rows_kernel`),
    what a plain call runs."""
    if name == AUTO:
        return dict(layout=AUTO)
    head, *flags = name.split("+")
    flag_options = dict(_FLAGS_BEFORE_O + _FLAGS_AFTER_O)
    options = dict(layout=None, ctas_per_sm=0, **{option: False for option in flag_options.values()})
    if head != "default":
        try:
            threads, rows = (int(n) for n in head.split("x"))
        except ValueError:
            raise ValueError(f"candidate {name!r}: the layout must be 'auto', 'default' or THREADSxROWS, e.g. 64x2") from None
        options["layout"] = (threads, rows)
    for flag in flags:
        if flag in flag_options:
            options[flag_options[flag]] = True
        elif flag.startswith("o") and flag[1:].isdigit():
            options["ctas_per_sm"] = int(flag[1:])
        else:
            raise ValueError(f"candidate {name!r}: unknown flag +{flag} ({', '.join(flag_options)}, oN)")
    if options["reread"] and not options["staged"]:
        raise ValueError(f"candidate {name!r}: +r re-reads the staged row, so it needs +s")
    if options["l1_staging"] and not options["staged"]:
        raise ValueError(f"candidate {name!r}: +l1 chooses how the staged copies are cached, so it needs +s")
    return options


#: the kernels the shipped bands name: the default tiling without its grid-stride loop and with
#: the PDL trigger at the end (`default+late+nl`: 70 registers instead of 100 at H=4096, 7 rows
#: an SM instead of 4), the same reading gamma after the PDL wait (`+g`: 64 registers, 8 rows an
#: SM: T=1024 H=4096 in one wave), and FlashInfer's own form (`128x1+s+l1+late+g+nl`)
_LATE, _LATE_G, _FI_FORM = "default+late+nl", "default+late+g+nl", "128x1+s+l1+late+g+nl"

#: Per width, the token counts [first, end) where a kernel other than the default tiling runs, by
#: kernel name (`parse_candidate`): the output of `layer-boundary bench cutedsl -- --bands-out`
#: on an H200 (each kernel timed side by side with the default tiling, 5 rounds, 15 token counts
#: a width). Only kernels whose PDL trigger sits at the end are chosen (docs/kernels.md says why);
#: neighbouring bands naming different kernels are near-ties (within ~2%). `ROWS_BANDS_ENV` (a
#: JSON file of the same form) replaces the table at import.
SHIPPED_ROWS_BANDS: dict = {
    2048: ((72, 192, _LATE_G), (320, 448, _LATE_G), (448, 1792, _LATE), (2560, 3584, _LATE_G), (3584, 6144, _LATE)),
    4096: ((1, 320, _LATE), (320, 576, _FI_FORM), (576, 896, _LATE), (896, 1152, _LATE_G), (1152, 1408, _LATE),
           (1408, 1792, _FI_FORM), (1792, 2560, _LATE_G), (2560, 16384, _LATE)),
    7168: ((9, 576, _LATE), (576, 704, _FI_FORM), (704, 1152, _LATE_G), (1152, 16384, _LATE)),
    8192: ((72, 448, _LATE), (448, 576, _LATE_G), (576, 896, _LATE), (896, 2560, _LATE_G), (3584, 16384, _LATE_G)),
}


#: environment variable naming a JSON band table ({"4096": [[first, end, name], ...]}) that
#: replaces the shipped one: a GPU other than the H200 the shipped table was measured on
ROWS_BANDS_ENV = "LAYER_BOUNDARY_CUTEDSL_ADD_NORM_BANDS"


def check_bands(bands: dict, source: str = "ROWS_BANDS") -> dict:
    """`bands` as {hidden: ((first, end, name), ...)}, each width's bands ordered and disjoint and
    every name a kernel name (`parse_candidate`); ValueError naming `source` otherwise."""
    checked = {}
    for hidden, rows in bands.items():
        end_before, width = 1, []
        for band in rows:
            first, end, name = band
            if not (isinstance(first, int) and isinstance(end, int) and end_before <= first < end):
                raise ValueError(
                    f"{source}: hidden {hidden}: band {list(band)} must start at or after {end_before} "
                    "and end after it starts (bands [first, end) in increasing order)"
                )
            try:
                parse_candidate(name)
            except ValueError as exc:
                raise ValueError(f"{source}: hidden {hidden}: {exc}") from None
            if name == AUTO:
                raise ValueError(f"{source}: hidden {hidden}: a band names a kernel, not {AUTO!r}")
            width.append((first, end, name))
            end_before = end
        checked[int(hidden)] = tuple(width)
    return checked


def load_bands(path: str) -> dict:
    """The band table in the JSON file `path` (`bench cutedsl -- --bands-out` writes one), checked."""
    with open(path) as f:
        return check_bands(json.load(f), f"{ROWS_BANDS_ENV}={path}")


def _rows_bands() -> dict:
    path = os.environ.get(ROWS_BANDS_ENV)
    return load_bands(path) if path else check_bands(SHIPPED_ROWS_BANDS)


#: the table plain calls use: the shipped one, or the file `ROWS_BANDS_ENV` names
ROWS_BANDS: dict = _rows_bands()


def pick_band(bands, rows: int, default):
    """The kernel of the (first, end, kernel) band holding `rows`, else `default`."""
    for first, end, kernel in bands:
        if first <= rows < end:
            return kernel
    return default


def rows_kernel(hidden: int, rows: int) -> str:
    """The name of the kernel `layout=AUTO` runs for `rows` rows of `hidden`."""
    return pick_band(ROWS_BANDS.get(hidden, ()), rows, "default")


def default_grid(rows: int, rows_per_cta: int = 1, num_sms: Optional[int] = None) -> int:
    """CTAs to launch for `rows` rows: one per `rows_per_cta` rows.

    The hardware then hands rows to SMs as CTAs retire, so the tail is at most one row per SM.
    (A grid capped at "SMs x CTAs per SM" would need the kernel's real occupancy: when fewer
    CTAs fit than assumed, the grid runs in uneven waves of multi-row CTAs.) The kernels still
    loop over rows, so any grid >= 1 is correct."""
    if rows <= 0:
        return 0
    return min(-(-rows // rows_per_cta), 2**31 - 1)
