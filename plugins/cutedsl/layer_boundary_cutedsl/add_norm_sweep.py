"""Where the CuTe DSL add + RMSNorm loses to FlashInfer's, and why: launch mode and buffers,
and (`--layouts`) which row layout of a CTA wins at each width.

    python -m layer_boundary_cutedsl.add_norm_sweep --out sweep.json
    python -m layer_boundary_cutedsl.add_norm_sweep --layouts --out layouts.json

At each (T, H) it times our kernel four ways by CUDA-graph replay on random bf16 data: launched
as a programmatic dependent (PDL, the default) or not, writing new buffers (four live buffers:
x, residual, norm, new residual) or in place (norm over x, sum over the residual: two buffers,
which is what FlashInfer's `fused_add_rmsnorm` does), and FlashInfer's on the same shapes. A
replayed call finds its data in L2 when the live buffers fit, so the in-place columns are the
like-for-like comparison with FlashInfer. Every variant's output is checked against the
default's first (the residual bit for bit, the norm within one rounding).

`--layouts` times the kernel in place with PDL (FlashInfer's mode) for every candidate layout
of a CTA (threads per row, rows per CTA: `LAYOUTS`) and for the default tiling, some of them
also with x and the residual staged through shared memory (cp.async, `STAGED`), against
FlashInfer, and prints per width the layout with the lowest worst ratio over the token counts
(what `AddNormVariant.layout` would default to, were any to beat the default tiling).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from layer_boundary.cli.args import OneLineParser, positive_int

from .bench import EPS, flashinfer_implementation, ratio_spread, time_side_by_side, write
from .kernels import fused_add_rmsnorm
from .kernels.tiling import AUTO, AddNormVariant, candidate_name, group_tiling, parse_candidate

DT = torch.bfloat16
_FI = "flashinfer"  # FlashInfer's key among the timed runs
#: (pdl, in_place) -> column name
MODES = {(True, False): "pdl", (False, False): "plain", (True, True): "pdl_inplace", (False, True): "plain_inplace"}
WIDTHS = (2048, 4096, 7168, 8192)
TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768)


def _inputs(tokens: int, hidden: int):
    gen = torch.Generator(device="cuda").manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
    r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(DT)
    return x, r, gamma


def _flashinfer():
    """(FlashInfer's fused_add_rmsnorm, None) once one small call of it has run, else (None, why):
    the sweep still ranks our kernels then, against our default."""
    try:
        import flashinfer.norm as fnorm

        x, r, gamma = _inputs(4, 4096)
        fnorm.fused_add_rmsnorm(x, r, gamma, EPS)
        torch.cuda.synchronize()
        print(f"flashinfer: fused_add_rmsnorm runs its {flashinfer_implementation(fnorm)} implementation", flush=True)
        return fnorm.fused_add_rmsnorm, None
    except Exception as exc:
        print(f"flashinfer not usable, ranking against our default: {type(exc).__name__}: {exc}", flush=True)
        return None, f"{type(exc).__name__}: {exc}"


def _measure_variants(t: int, hidden: int, fi, iters: int, repeats: int, variants, rounds: int = 1) -> dict:
    """The time at (t, hidden) of each (name, in_place, launch options) in `variants`, each
    checked against a plain call first (the new residual bit for bit, the norm within one
    rounding), and FlashInfer's (`flashinfer_us`) when it is importable. With `rounds` > 1 every
    kernel is timed that many times, the order rotated each round, and the median taken: a ratio
    then compares times taken side by side, not minutes apart (`spread`: each kernel's lowest
    and highest per-round ratio to FlashInfer)."""
    x, r, gamma = _inputs(t, hidden)
    ref_n, ref_r = fused_add_rmsnorm(x, r, gamma, EPS)
    n_iters = iters if t * hidden <= 1024 * 8192 else max(2, iters // 4)
    runs = {}
    for name, in_place, options in variants:
        xx, rr = x.clone(), r.clone()
        normed, res = (xx, rr) if in_place else (torch.empty_like(x), torch.empty_like(r))
        fused_add_rmsnorm(xx, rr, gamma, EPS, out=normed, residual_out=res, **options)
        torch.cuda.synchronize()
        if not torch.equal(res, ref_r):
            raise AssertionError(f"{name} at T={t} H={hidden}: new residual differs")
        if not torch.allclose(normed.float(), ref_n.float(), rtol=2**-7, atol=2**-7):
            raise AssertionError(f"{name} at T={t} H={hidden}: norm differs beyond a rounding")
        runs[name] = lambda xx=xx, rr=rr, normed=normed, res=res, options=options: fused_add_rmsnorm(  # noqa: E731
            xx, rr, gamma, EPS, out=normed, residual_out=res, **options)
    if fi is not None:
        fx, fr = x.clone(), r.clone()
        runs[_FI] = lambda: fi(fx, fr, gamma, EPS)
    times = time_side_by_side(runs, n_iters, repeats, rounds)
    row = dict(tokens=t, hidden=hidden, rounds=rounds, us={name: statistics.median(v) for name, v in times.items() if name != _FI})
    if fi is not None:
        row["flashinfer_us"] = statistics.median(times[_FI])
        if rounds > 1:
            row["spread"] = {name: ratio_spread(v, times[_FI]) for name, v in times.items() if name != _FI}
    return row


def _measure(t: int, hidden: int, fi, iters: int, repeats: int) -> dict:
    """Every launch mode's time at (t, hidden), and the in-place and default ones over FlashInfer's."""
    modes = [(name, in_place, dict(pdl=pdl)) for (pdl, in_place), name in MODES.items()]
    row = _measure_variants(t, hidden, fi, iters, repeats, modes)
    if "flashinfer_us" in row:
        row["inplace_over_flashinfer"] = row["us"]["pdl_inplace"] / row["flashinfer_us"]
        row["default_over_flashinfer"] = row["us"]["pdl"] / row["flashinfer_us"]
    return row


#: (threads per row, rows per CTA) candidates; at most MAX_VPT vectors a thread (registers)
LAYOUTS = ((32, 4), (32, 8), (64, 2), (64, 4), (128, 1), (128, 2), (256, 1))
MAX_VPT = 16


#: layouts also tried with staged loads (cp.async through shared memory, as FlashInfer loads);
#: 32x4, 64x2 and 128x1 are FlashInfer's own CTA shapes at H 2048, 4096 and 7168/8192
STAGED = (None, (32, 4), (64, 2), (128, 1), (256, 1))
#: layouts also tried with the PDL trigger at the end of the kernel (as FlashInfer's norms have it)
LATE = (None, (64, 2), (256, 1))
#: layouts also tried staged and with the late trigger: FlashInfer's kernel as a whole (the
#: sweep found ours in that shape 1.13-1.24x FlashInfer's at T=1024 H=4096: the shape is not why
#: it wins there)
STAGED_LATE = (None, (32, 4), (64, 2), (128, 1))
#: staged layouts also tried re-reading the row from shared memory for the norm (no row held in
#: registers across the reduction), at the compiler's register count and capped so that
#: `ctas` CTAs fit an SM: (layout, ctas or 0)
REREAD = ((None, 0), (None, 8), ((128, 2), 0), ((128, 2), 4), ((64, 2), 4), ((256, 1), 0))


def check_candidates(parser, names) -> list:
    """Each of `names` parsed (`parse_candidate`), or the command line refused with the reason:
    before any GPU work."""
    options = []
    for name in names:
        try:
            options.append(parse_candidate(name))
        except ValueError as exc:
            parser.error(str(exc))
    return options


def _fits(hidden: int, options: dict) -> bool:
    """Whether the kernel with `options` can be built at `hidden` (its layout fits the row, its
    staged rows fit a CTA's shared memory); `auto` always can."""
    if options.get("layout") == AUTO:
        return True
    try:
        AddNormVariant(DT, hidden, **options)
    except ValueError:
        return False
    return True


def candidate_layouts(hidden: int) -> list:
    """The names of the kernels the sweep tries at `hidden`: the default tiling and every layout
    of `LAYOUTS` that fits a row of `hidden`, with register loads; `STAGED`'s ones again staged,
    `STAGED_LATE`'s with both, `REREAD`'s staged and re-read, `LATE`'s with the late PDL trigger.
    Staged ones whose two rows take more shared memory than a CTA gets are left out."""
    fits = [None]
    for layout in LAYOUTS:
        try:
            tiling = group_tiling(hidden, DT, *layout)
        except ValueError:
            continue
        if tiling.vpt <= MAX_VPT:
            fits.append(layout)
    out = [candidate_name(layout) for layout in fits]
    for layout in fits:
        if not _fits(hidden, dict(layout=layout, staged=True)):  # more shared memory than a CTA gets
            continue
        if layout in STAGED:
            out.append(candidate_name(layout, staged=True))
        if layout in STAGED_LATE:
            out.append(candidate_name(layout, staged=True, late=True))
        out += [candidate_name(layout, staged=True, reread=True, ctas_per_sm=ctas) for lay, ctas in REREAD if lay == layout]
    out += [candidate_name(layout, late=True) for layout in fits if layout in LATE]
    return out


def _layout_variants(hidden: int, names=None) -> list:
    """(name, in place, options) of each candidate (`names`, else `candidate_layouts`) that can
    be built at `hidden`, in place (FlashInfer's mode)."""
    variants = [(name, True, parse_candidate(name)) for name in (names or candidate_layouts(hidden))]
    return [v for v in variants if _fits(hidden, v[2])]


def sweep_layouts(widths, tokens, iters: int, repeats: int, names=None, rounds: int = 1) -> dict:
    """Every candidate layout (or those `names`d) at every (T, H), and per width the layout whose
    worst ratio to FlashInfer over the token counts is lowest (to the default tiling without
    FlashInfer)."""
    fi, fi_error = _flashinfer()
    rows, best = [], {}
    for hidden in widths:
        mine = []
        variants = _layout_variants(hidden, names)
        for t in tokens:
            row = _measure_variants(t, hidden, fi, iters, repeats, variants, rounds)
            rows.append(row)
            mine.append(row)
            base = row.get("flashinfer_us", row["us"]["default"])
            spread = row.get("spread", {})
            cells = "  ".join(
                f"{k} {v / base:5.2f}" + (f" [{spread[k][0]:.2f}-{spread[k][1]:.2f}]" if k in spread else "") for k, v in row["us"].items()
            )
            print(f"T={t:6d} H={hidden}: {'fi' if fi else 'default'} {base:7.2f} us; ours/that: {cells}", flush=True)
        worst = {}
        for name in mine[0]["us"]:
            worst[name] = max(r["us"][name] / r.get("flashinfer_us", r["us"]["default"]) for r in mine)
        choice = min(worst, key=worst.get)
        best[hidden] = dict(layout=choice, worst_ratio=worst[choice], worst_by_layout=worst)
        print(f"H={hidden}: best layout {choice} (worst ratio {worst[choice]:.3f}); "
              + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()), flush=True)
    return dict(rows=rows, best=best, flashinfer_error=fi_error)


def suggest_bands(rows, kernels, margin: float = 0.01) -> dict:
    """A `tiling.ROWS_BANDS` table from `sweep_layouts` rows: at each measured token count the
    fastest of `kernels` where it beats the default tiling by more than `margin`, runs of one
    kernel merged into a band [first, end) whose edges sit halfway to the neighbouring counts
    (the last measured count's band ends at twice it). Widths without a winner get no entry."""
    bands = {}
    for hidden in sorted({r["hidden"] for r in rows}):
        mine = sorted((r for r in rows if r["hidden"] == hidden), key=lambda r: r["tokens"])
        counts = [r["tokens"] for r in mine]
        picks = []
        for r in mine:
            timed = {k: r["us"][k] for k in kernels if k in r["us"]}
            best = min(timed, key=timed.get) if timed else None
            picks.append(best if best and timed[best] < r["us"]["default"] * (1 - margin) else None)
        width_bands = []
        for i, name in enumerate(picks):
            if name is None:
                continue
            first = 1 if i == 0 else (counts[i - 1] + counts[i] + 1) // 2
            end = 2 * counts[i] if i + 1 == len(counts) else (counts[i] + counts[i + 1] + 1) // 2
            if width_bands and width_bands[-1][2] == name and width_bands[-1][1] == first:
                width_bands[-1][1] = end
            else:
                width_bands.append([first, end, name])
        if width_bands:
            bands[hidden] = width_bands
    return bands


def sweep(widths, tokens, iters: int, repeats: int) -> dict:
    fi, fi_error = _flashinfer()
    rows = []
    for hidden in widths:
        for t in tokens:
            row = _measure(t, hidden, fi, iters, repeats)
            rows.append(row)
            fi_txt = f"fi {row['flashinfer_us']:7.2f}  inplace/fi {row['inplace_over_flashinfer']:5.2f}" if "flashinfer_us" in row else ""
            cells = "  ".join(f"{k} {v:7.2f}" for k, v in row["us"].items())
            print(f"T={t:6d} H={hidden}: {cells}  {fi_txt}", flush=True)
    return dict(rows=rows, flashinfer_error=fi_error)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m layer_boundary_cutedsl.add_norm_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=positive_int, default=20)
    ap.add_argument("--repeats", type=positive_int, default=30)
    ap.add_argument("--widths", type=positive_int, nargs="*", default=list(WIDTHS))
    ap.add_argument("--tokens", type=positive_int, nargs="*", default=list(TOKENS))
    ap.add_argument("--layouts", action="store_true", help="rank the CTA row layouts instead of the launch modes")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="with --layouts, time every kernel and FlashInfer this many times in rotated order (medians)")
    ap.add_argument("--candidates", nargs="*", default=None,
                    help="with --layouts, only these kernels (names as printed, e.g. default 256x1 default+s+r+o8)")
    ap.add_argument("--bands-out", default="",
                    help="with --layouts, write a ROWS_BANDS table of the kernels that beat the default here (JSON; "
                         "LAYER_BOUNDARY_CUTEDSL_ADD_NORM_BANDS=FILE makes plain calls use it)")
    ap.add_argument("--band-kernels", nargs="*", default=None,
                    help="the kernels --bands-out may choose (default: the candidates with the trigger at the end, "
                         "whose dependents do not hold SM slots while they wait)")
    args = ap.parse_args(argv)
    if args.bands_out and not args.layouts:
        ap.error("--bands-out ranks layouts: add --layouts")
    if args.candidates is not None and not args.layouts:
        ap.error("--candidates ranks layouts: add --layouts")
    if args.rounds > 1 and not args.layouts:
        ap.error("--rounds times the layouts side by side: add --layouts")
    check_candidates(ap, args.candidates or ())
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to sweep", file=sys.stderr)
        return 2
    t0 = time.time()
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.layouts:
        payload.update(sweep_layouts(args.widths, args.tokens, args.iters, args.repeats, args.candidates, args.rounds))
        if args.bands_out:
            names = args.band_kernels
            if names is None:
                names = [n for n in args.candidates or () if n != AUTO and parse_candidate(n)["late_trigger"]]
            payload["bands"] = suggest_bands(payload["rows"], names)
            write(args.bands_out, {str(h): b for h, b in payload["bands"].items()})
            print(f"bands (ROWS_BANDS form) written to {args.bands_out}: {payload['bands']}", flush=True)
    else:
        payload.update(sweep(args.widths, args.tokens, args.iters, args.repeats))
    payload["seconds"] = time.time() - t0
    write(args.out, payload)
    print(f"done in {payload['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
