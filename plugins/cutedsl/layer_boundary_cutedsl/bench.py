"""Benchmark of the cutedsl kernels on one GPU: check, then time, then print a table.

    python benchmarks/cutedsl_bench.py --out results.json [--quick] [--no-flashinfer]

(a) fused residual add + RMSNorm over T 1..32768 and H 2048/4096/7168/8192 against the device's
    copy bandwidth measured in the same run, an unfused torch path, and FlashInfer's
    `flashinfer.norm.fused_add_rmsnorm` (which implementation it dispatched to, "cute-dsl" or
    "cuda", is recorded, and its output is compared with ours; FlashInfer missing or failing is
    a failure of the bench, unless --no-flashinfer). FlashInfer runs in a child process (its first
    call may JIT-compile for minutes; the child is killed at the time budget), and our kernel is
    timed again there beside it, both in place on the same buffers, in rotated rounds (--rounds):
    ours/fi compares those, over --buffer-sets pairs of buffers (where two buffers sit moves an
    L2-resident kernel's time by 2-8%, not the same way for each kernel). Times from two
    processes differ by up to ~15% at the L2-resident sizes, where the buffers' physical pages
    set the kernel's time. Bandwidth counts the bytes a perfect kernel
    moves: read x and residual, write the new residual and the norm (4 * T * H * 2 bytes). The
    copy baseline is the faster of a copy-engine `copy_` and an SM copy kernel of 1 GiB, each
    counted as the bytes it reads plus the bytes it writes (2 GiB); both are recorded.
(b) MoE finalize + add + RMSNorm (top_k 8, gathered rows, shared expert) against the unfused
    torch path (gather, weight, sum, add shared, add + norm).

Each case is timed by CUDA-graph replay (ITERS calls per graph, events around each replay,
median of REPEATS replays) on random data after a correctness check against the float64
reference. Our results are written to --out before flashinfer is tried (its first use may
JIT-compile for minutes), and again after.

`--bands-out FILE` times, instead, the add + RMSNorm kernels a plain call may choose by token
count (`--band-kernels`) against the width's default tiling, side by side (`--rounds` rotated
rounds, in place), at every width and token count of the band grid, and writes the
`tiling.ROWS_BANDS` table those times suggest (`suggest_bands`): the shipped table is this
command's output on an H200; `LAYER_BOUNDARY_CUTEDSL_ADD_NORM_BANDS=FILE` makes plain calls use
another GPU's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from layer_boundary.plugin import OneLineParser, cuda_event_us, positive_float, positive_int
from layer_boundary_cutedsl.kernels.tiling import AUTO, check_hidden, parse_candidate
from layer_boundary_cutedsl.kernels import (
    add_rmsnorm_reference,
    fused_add_rmsnorm,
    moe_finalize_add_rmsnorm,
    moe_finalize_add_rmsnorm_reference,
)

EPS = 1e-6
DT = torch.bfloat16
#: rounds ours and FlashInfer's are timed in, side by side (`time_side_by_side`)
ROUNDS = 5
#: pairs of buffers (x, residual) they are timed on, ROUNDS rounds each (`buffer_sets`)
BUFFER_SETS = 3
#: `--bands-out`'s grid: the widths, the token counts (the bands' edges fall halfway between
#: neighbours), and the kernels a band may name: those whose PDL trigger sits at the end (an early
#: trigger lets the next launch's CTAs hold SM slots while they wait, and one-wave grids spike)
BAND_WIDTHS = (2048, 4096, 7168, 8192)
BAND_TOKENS = (1, 16, 128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096, 8192)
BAND_KERNELS = ("default+late+nl", "default+late+g+nl", "128x1+s+l1+late+g+nl")
#: how much faster than the default tiling a kernel must be for a band to name it
BAND_MARGIN = 0.01


def add_norm_inputs(tokens: int, hidden: int):
    """(x, residual, gamma): random bf16 rows of a case, the same for every use of (tokens, hidden)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
    r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(DT)
    return x, r, gamma


def time_graph(fn, iters: int, repeats: int) -> float:
    """Median microseconds per call of `fn` under CUDA-graph replay."""
    fn()  # eager warm-up: compiles and loads kernels before capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = [cuda_event_us(graph.replay) / iters for _ in range(repeats)]
    del graph
    return statistics.median(times)


def time_side_by_side(runs: dict, iters: int, repeats: int, rounds: int) -> dict:
    """name -> the per-round medians (`time_graph`) of each callable in `runs`, all timed
    `rounds` times with the order rotated each round: ratios between them then compare times
    taken seconds apart in one process on one set of buffers, not in two processes (whose
    buffers land on other physical pages, which moves an L2-resident kernel's time by ~5-15%)."""
    names = list(runs)
    times = {name: [] for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            times[name].append(time_graph(runs[name], iters, repeats))
    return times


def ratio_spread(times: list, baseline: list) -> list:
    """[lowest, highest] per-round ratio of `times` to `baseline` (rounds timed side by side)."""
    ratios = [a / b for a, b in zip(times, baseline)]
    return [min(ratios), max(ratios)]


def copy_bandwidths(iters: int, repeats: int) -> dict:
    """GB/s of device-to-device copies of 1 GiB, each counting the bytes read plus the bytes
    written (2 GiB a copy): "copy_engine" (`dst.copy_(src)`, a memcpy node in the graph, run by
    a copy engine) and "sm_kernel" (an elementwise kernel reading src and writing dst:
    `torch.neg(src, out=dst)`, the access pattern of a bandwidth-bound kernel)."""
    n = 1 << 29  # 2^29 bf16 = 1 GiB
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(DT)
    dst = torch.empty_like(src)
    moved = 2 * n * src.element_size()  # read n elements, write n elements
    out = {}
    for name, fn in (("copy_engine", lambda: dst.copy_(src)), ("sm_kernel", lambda: torch.neg(src, out=dst))):
        us = time_graph(fn, max(2, iters // 5), repeats)
        out[name] = moved / (us * 1e-6) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return out


def torch_add_rmsnorm(x, r, gamma):
    total = x.float() + r.float()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
    return normed.to(x.dtype), total.to(r.dtype)


def check_add_norm(x, r, gamma, normed, res) -> float:
    """Max error of the norm relative to the float64 reference, in units of the row's max |ref|."""
    assert torch.equal(res, (x.float() + r.float()).to(x.dtype)), "new residual mismatch"
    ref, _ = add_rmsnorm_reference(x[:256], r[:256], gamma, EPS, exact=True)
    err = ((normed[:256].double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
    assert err < 2**-7, f"normed error {err}"
    return err


def bench_add_norm(cases, iters, repeats, copy_gbs, results, options=None):
    """Our add + RMSNorm at each (T, H): new buffers, in place, the torch baseline. `options`:
    `fused_add_rmsnorm`'s kernel options (`--kernel`), else the default kernel."""
    options = options or {}
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    for tokens, hidden in cases:
        x, r, gamma = add_norm_inputs(tokens, hidden)
        normed, res = torch.empty_like(x), torch.empty_like(r)
        fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res, **options)
        torch.cuda.synchronize()
        err = check_add_norm(x, r, gamma, normed, res)
        nbytes = 4 * tokens * hidden * 2
        ours = time_graph(lambda: fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res, **options), iters, repeats)
        # in place (norm over x, sum over the residual), as FlashInfer's runs: two live buffers, not four
        xi, ri = x.clone(), r.clone()
        in_place = time_graph(lambda: fused_add_rmsnorm(xi, ri, gamma, EPS, out=xi, residual_out=ri, **options), iters, repeats)
        # the torch baseline allocates fp32 temporaries per call: fewer calls per graph
        unfused = time_graph(lambda: torch_add_rmsnorm(x, r, gamma), max(2, iters // 4), repeats)
        gbs = nbytes / (ours * 1e-6) / 1e9
        results.append(
            dict(
                kernel="add_rmsnorm", tokens=tokens, hidden=hidden, bytes=nbytes, cutedsl_us=ours, torch_unfused_us=unfused,
                cutedsl_gbs=gbs, copy_gbs=copy_gbs, frac_of_copy=gbs / copy_gbs, max_rel_err=err, fits_l2=nbytes <= l2,
                cutedsl_inplace_us=in_place,
            )
        )
        print(f"  add_rmsnorm T={tokens:6d} H={hidden}: {ours:8.2f} us  {gbs:7.0f} GB/s = {100 * gbs / copy_gbs:5.1f}% of copy", flush=True)
        del x, r, normed, res, xi, ri


def torch_moe(routed, indices, weights, shared, residual, gamma):
    picked = routed[indices.clamp(min=0).long()].float()  # [T, k, H]
    w = torch.where(indices >= 0, weights, torch.zeros_like(weights))
    total = (picked * w.unsqueeze(-1)).sum(1) + shared.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
    return normed.to(residual.dtype), total.to(residual.dtype)


def bench_moe(cases, top_k, iters, repeats, results):
    for tokens, hidden in cases:
        gen = torch.Generator(device="cuda").manual_seed(tokens * 3 + hidden)
        rows = tokens * top_k
        routed = torch.randn(rows, hidden, generator=gen, device="cuda").to(DT)
        indices = torch.randperm(rows, generator=gen, device="cuda").view(tokens, top_k).to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
        shared = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
        residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(DT)
        gamma = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(DT)
        normed, res = torch.empty_like(residual), torch.empty_like(residual)
        args = (routed, indices, weights, residual, gamma, EPS)
        moe_finalize_add_rmsnorm(*args, shared=shared, out=normed, residual_out=res)
        torch.cuda.synchronize()
        n = min(tokens, 64)
        ref_normed, ref_total = moe_finalize_add_rmsnorm_reference(
            routed, indices[:n], weights[:n], shared[:n], residual[:n], gamma, EPS, exact=True
        )
        err = ((normed[:n].double() - ref_normed).abs() / ref_normed.abs().clamp(min=1e-2)).max().item()
        assert err < 2**-6, f"moe normed error {err}"
        nbytes = (top_k + 4) * tokens * hidden * 2  # k routed rows, shared, residual in; 2 out
        ours = time_graph(lambda: moe_finalize_add_rmsnorm(*args, shared=shared, out=normed, residual_out=res), iters, repeats)
        unfused = time_graph(lambda: torch_moe(routed, indices, weights, shared, residual, gamma), max(2, iters // 4), repeats)
        gbs = nbytes / (ours * 1e-6) / 1e9
        results.append(
            dict(
                kernel="moe_finalize_add_rmsnorm", tokens=tokens, hidden=hidden, top_k=top_k, bytes=nbytes,
                cutedsl_us=ours, torch_unfused_us=unfused, cutedsl_gbs=gbs, max_rel_err=err,
            )
        )
        print(f"  moe T={tokens:6d} H={hidden} k={top_k}: {ours:8.2f} us vs torch {unfused:8.2f} us", flush=True)
        del routed, indices, weights, shared, residual, normed, res


def flashinfer_implementation(fnorm) -> str:
    """Which implementation `flashinfer.norm.fused_add_rmsnorm` dispatches to on this GPU:
    "cute-dsl" (its CuTe DSL kernels) or "cuda" (its CUDA JIT kernels), as FlashInfer 0.7.2 decides."""
    device = torch.device("cuda", torch.cuda.current_device())
    use_cuda = getattr(fnorm, "_use_cuda_norm", None)
    if use_cuda is not None:
        return "cuda" if use_cuda(device) else "cute-dsl"
    return "cuda" if getattr(fnorm, "_USE_CUDA_NORM", True) else "cute-dsl"


def compare_flashinfer(fi_fused, tokens, hidden, options) -> dict:
    """FlashInfer's output on the inputs ours ran on (copies: it works in place), against ours
    and the float64 reference: the new residual bit-exact?, the norm's max error relative to
    the reference (the measure `check_add_norm` uses) and its max difference from ours in bf16 ulps."""
    x, r, gamma = add_norm_inputs(tokens, hidden)
    ours_normed, ours_res = fused_add_rmsnorm(x, r, gamma, EPS, **options)
    fi_x, fi_r = x.clone(), r.clone()
    fi_fused(fi_x, fi_r, gamma, EPS)
    torch.cuda.synchronize()
    n = min(tokens, 256)
    ref, _ = add_rmsnorm_reference(x[:n], r[:n], gamma, EPS, exact=True)
    err = ((fi_x[:n].double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
    ulp = 2.0 ** torch.floor(torch.log2(ours_normed.float().abs().clamp(min=2**-6))) * 2**-7  # bf16 ulp (1/64 floor)
    vs_ours = ((fi_x.float() - ours_normed.float()).abs() / ulp).max().item()
    return dict(flashinfer_residual_equals_ours=bool(torch.equal(fi_r, ours_res)), flashinfer_max_rel_err=err,
                flashinfer_vs_ours_max_ulps=vs_ours)


def buffer_sets(tokens: int, hidden: int, sets: int, device: str = "cuda") -> list:
    """`sets` pairs (x, residual) of random bf16 rows, all alive at once, a spacer of a different
    size before each: where two buffers sit relative to each other moves an L2-resident kernel's
    time by 2-8%, and not the same way for every kernel, so
    a ratio of two kernels taken on one pair is partly that pair's luck."""
    pairs, spacers = [], []
    for k in range(sets):
        spacers.append(torch.empty((2 * k + 3) << 20, device=device, dtype=torch.uint8))  # 3, 5, 7 MiB ... (the large pool)
        pairs.append((torch.randn(tokens, hidden, device=device).to(DT), torch.randn(tokens, hidden, device=device).to(DT)))
    return pairs


def bench_flashinfer(results, iters, repeats, options=None, rounds=ROUNDS, sets=BUFFER_SETS):
    """flashinfer.norm.fused_add_rmsnorm (in place: input <- norm, residual <- sum) on the same
    shapes: its implementation, its output against ours, and its time beside ours (`options`:
    our kernel), both in place on the same buffers, `rounds` rounds in rotated order
    (`time_side_by_side`) on each of `sets` pairs of buffers (`buffer_sets`):
    `ours_over_flashinfer` is the ratio of the medians over every round of every pair. Returns
    "ok" or what failed."""
    options = options or {}
    try:
        import flashinfer
        import flashinfer.norm as fnorm
        from flashinfer.norm import fused_add_rmsnorm as fi_fused
    except Exception as exc:  # not installed, or its import fails: the bench fails
        print(f"FAIL: flashinfer does not import: {type(exc).__name__}: {exc}", flush=True)
        return f"failed: flashinfer does not import: {type(exc).__name__}: {exc}"
    implementation = flashinfer_implementation(fnorm)
    print(f"  flashinfer {getattr(flashinfer, '__version__', '?')}: fused_add_rmsnorm runs its {implementation} implementation", flush=True)
    for row in results:
        if row["kernel"] != "add_rmsnorm":
            continue
        tokens, hidden = row["tokens"], row["hidden"]
        try:
            t0 = time.time()
            row.update(compare_flashinfer(fi_fused, tokens, hidden, options), flashinfer_implementation=implementation)
            first = time.time() - t0
            gamma = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(DT)
            times = dict(ours=[], flashinfer=[])
            for x, r in buffer_sets(tokens, hidden, sets):
                for name, per_round in time_side_by_side(
                        dict(ours=lambda: fused_add_rmsnorm(x, r, gamma, EPS, out=x, residual_out=r, **options),
                             flashinfer=lambda: fi_fused(x, r, gamma, EPS)),
                        iters, repeats, rounds).items():
                    times[name] += per_round
            us, ours = statistics.median(times["flashinfer"]), statistics.median(times["ours"])
            row.update(flashinfer_us=us, flashinfer_gbs=row["bytes"] / (us * 1e-6) / 1e9, flashinfer_rounds=rounds,
                       flashinfer_buffer_sets=sets, cutedsl_beside_flashinfer_us=ours, ours_over_flashinfer=ours / us,
                       ours_over_flashinfer_spread=ratio_spread(times["ours"], times["flashinfer"]))
            print(f"  flashinfer T={tokens:6d} H={hidden}: {us:8.2f} us beside ours {ours:8.2f} us (first call {first:.1f} s); "
                  f"residual equal: {row['flashinfer_residual_equals_ours']}, norm vs ours {row['flashinfer_vs_ours_max_ulps']:.1f} ulp",
                  flush=True)
            del x, r
            torch.cuda.empty_cache()
        except Exception as exc:
            row["flashinfer_error"] = f"{type(exc).__name__}: {exc}"
            print(f"FAIL: flashinfer failed at T={tokens} H={hidden}: {exc}", flush=True)
            return f"failed: {type(exc).__name__}: {exc}"
    return "ok"


def flashinfer_in_child(results, iters, repeats, budget_s: float, kernel: str = "auto", rounds: int = ROUNDS,
                        sets: int = BUFFER_SETS):
    """Run bench_flashinfer in a child process killed after `budget_s` (its first call may
    JIT-compile for minutes), with our kernel `kernel` (a kernel name) timed beside it there;
    merge what it measured into `results`."""
    import subprocess
    import tempfile

    if budget_s < 20:
        return f"skipped: {budget_s:.0f} s of the time budget left"
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(dict(results=results, iters=iters, repeats=repeats, rounds=rounds, sets=sets), f)
        cmd = [sys.executable, "-m", "layer_boundary_cutedsl.bench", "--kernel", kernel, "--flashinfer-child", src, dst]
        try:
            proc = subprocess.run(cmd, timeout=budget_s, capture_output=True, text=True)
            sys.stdout.write(proc.stdout[-4000:])
            if proc.returncode != 0:
                sys.stdout.write(proc.stderr[-2000:])
        except subprocess.TimeoutExpired:
            return f"timed out after {budget_s:.0f} s (JIT compile?); rerun with a larger --budget-s"
        if not os.path.exists(dst):
            return f"child failed (rc {proc.returncode})"
        with open(dst) as f:
            child = json.load(f)
    for mine, theirs in zip(results, child["results"]):  # every field the child added (times, ratio, comparison)
        mine.update({key: value for key, value in theirs.items() if "flashinfer" in key})
    return child["status"]


def check_candidates(parser, names) -> list:
    """`fused_add_rmsnorm`'s options of each kernel name (`tiling.parse_candidate`), or the
    command line refused with the reason: before any GPU work."""
    options = []
    for name in names:
        try:
            options.append(parse_candidate(name))
        except ValueError as exc:
            parser.error(str(exc))
    return options


def time_kernels(tokens: int, hidden: int, names, iters: int, repeats: int, rounds: int) -> dict:
    """{name: median us} of the default tiling and of each kernel in `names` at (tokens, hidden),
    each in place on its own copy of the inputs, checked against a plain call first (the new
    residual bit for bit, the norm within one rounding), timed side by side (`time_side_by_side`)."""
    x, r, gamma = add_norm_inputs(tokens, hidden)
    ref_n, ref_r = fused_add_rmsnorm(x, r, gamma, EPS)
    runs = {}
    for name in ("default", *names):
        options = parse_candidate(name)
        xx, rr = x.clone(), r.clone()
        fused_add_rmsnorm(xx, rr, gamma, EPS, out=xx, residual_out=rr, **options)
        torch.cuda.synchronize()
        if not torch.equal(rr, ref_r):
            raise AssertionError(f"{name} at T={tokens} H={hidden}: new residual differs")
        if not torch.allclose(xx.float(), ref_n.float(), rtol=2**-7, atol=2**-7):
            raise AssertionError(f"{name} at T={tokens} H={hidden}: norm differs beyond a rounding")
        runs[name] = functools.partial(fused_add_rmsnorm, xx, rr, gamma, EPS, out=xx, residual_out=rr, **options)
    times = time_side_by_side(runs, iters if tokens * hidden <= 1024 * 8192 else max(2, iters // 4), repeats, rounds)
    return {name: statistics.median(per_round) for name, per_round in times.items()}


def suggest_bands(rows, kernels, margin: float = BAND_MARGIN) -> dict:
    """A `tiling.ROWS_BANDS` table from timed rows ({hidden, tokens, us: {name: us}}): at each
    token count the fastest of `kernels` where it beats the default tiling by more than `margin`,
    runs of one kernel merged into a band [first, end) whose edges sit halfway to the
    neighbouring counts (the last count's band ends at twice it). Widths without a winner get no
    entry."""
    bands = {}
    for hidden in sorted({r["hidden"] for r in rows}):
        mine = sorted((r for r in rows if r["hidden"] == hidden), key=lambda r: r["tokens"])
        counts = [r["tokens"] for r in mine]
        width_bands = []
        for i, r in enumerate(mine):
            timed = {k: r["us"][k] for k in kernels if k in r["us"]}
            best = min(timed, key=timed.get) if timed else None
            if best is None or timed[best] >= r["us"]["default"] * (1 - margin):
                continue
            first = 1 if i == 0 else (counts[i - 1] + counts[i] + 1) // 2
            end = 2 * counts[i] if i + 1 == len(counts) else (counts[i] + counts[i + 1] + 1) // 2
            if width_bands and width_bands[-1][2] == best and width_bands[-1][1] == first:
                width_bands[-1][1] = end
            else:
                width_bands.append([first, end, best])
        if width_bands:
            bands[hidden] = width_bands
    return bands


def measure_bands(widths, tokens, kernels, iters: int, repeats: int, rounds: int) -> dict:
    """`time_kernels` at every (T, H) of the grid, a line each, and the bands they suggest."""
    rows = []
    for hidden in widths:
        for t in tokens:
            us = time_kernels(t, hidden, kernels, iters, repeats, rounds)
            rows.append(dict(tokens=t, hidden=hidden, rounds=rounds, us=us))
            cells = "  ".join(f"{name} {v / us['default']:5.2f}" for name, v in us.items() if name != "default")
            print(f"T={t:6d} H={hidden}: default {us['default']:7.2f} us; kernel/default: {cells}", flush=True)
    return dict(rows=rows, bands=suggest_bands(rows, kernels))


def table(results) -> str:
    lines = []
    head = (f"{'kernel':<26}{'T':>7}{'H':>6}{'cutedsl us':>12}{'GB/s':>8}{'%copy':>7}{'torch us':>10}{'in place':>10}"
            f"{'flashinfer us':>15}{'ours beside':>13}{'ours/fi':>9}{'spread':>12}")
    lines.append("'cutedsl us' writes new buffers, 'in place' overwrites its inputs (this process); 'flashinfer us' and "
                 "'ours beside' are both in place on the same buffers in one process, timed in rotated rounds on "
                 "each of a few pairs of buffers: ours/fi is their medians' ratio, spread the lowest and highest round's")
    lines.append(head)
    lines.append("-" * len(head))
    for r in results:
        frac = f"{100 * r['frac_of_copy']:6.1f}%" if "frac_of_copy" in r else f"{'':>7}"
        if r.get("fits_l2"):  # replayed calls find the data in L2: above the DRAM copy rate is possible
            frac = frac[1:] + "*"
        fi = f"{r['flashinfer_us']:15.2f}" if "flashinfer_us" in r else f"{'-':>15}"
        fi += f"{r['cutedsl_beside_flashinfer_us']:13.2f}" if "cutedsl_beside_flashinfer_us" in r else f"{'-':>13}"
        fi += f"{r['ours_over_flashinfer']:9.2f}" if "ours_over_flashinfer" in r else f"{'-':>9}"
        low, high = r.get("ours_over_flashinfer_spread", (None, None))
        fi += f"{f'{low:.2f}-{high:.2f}':>12}" if low is not None else f"{'-':>12}"
        in_place = f"{r['cutedsl_inplace_us']:10.2f}" if "cutedsl_inplace_us" in r else f"{'-':>10}"
        name = r["kernel"] + (f" k{r['top_k']}" if "top_k" in r else "")
        lines.append(
            f"{name:<26}{r['tokens']:>7}{r['hidden']:>6}{r['cutedsl_us']:12.2f}{r['cutedsl_gbs']:8.0f}{frac}{r['torch_unfused_us']:10.2f}"
            f"{in_place}{fi}"
        )
    if any(r.get("fits_l2") for r in results):
        lines.append("* the inputs and outputs fit in the L2 cache, which serves the replayed calls faster than DRAM")
    return "\n".join(lines)


def write(path, payload):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def shape(text: str) -> tuple:
    """'1024x4096' -> (1024, 4096): an add + RMSNorm case of --shapes, its width checked as the
    kernel checks it (`check_hidden`), so a bad one stops the bench before the GPU work."""
    tokens, sep, hidden = text.lower().partition("x")
    if not (sep and tokens.isdigit() and hidden.isdigit() and int(tokens) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKENSxHIDDEN (e.g. 1024x4096)")
    try:
        check_hidden(int(hidden), DT)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return int(tokens), int(hidden)


def check_band_args(parser, args) -> tuple:
    """(kernels, widths, token counts) of `--bands-out`, or the command line refused: band options
    without --bands-out, --bands-out with --shapes, a band kernel that is not a kernel name or is
    `auto`, a width the kernels cannot take."""
    band_options = [f"--{name.replace('_', '-')}" for name in ("band_kernels", "band_widths", "band_tokens") if getattr(args, name)]
    if not args.bands_out:
        if band_options:
            parser.error(f"{' '.join(band_options)} choose what --bands-out times: add --bands-out FILE")
        return (), (), ()
    if args.shapes:
        parser.error("--bands-out times the band grid (--band-widths x --band-tokens), not --shapes")
    kernels = tuple(args.band_kernels or BAND_KERNELS)
    check_candidates(parser, kernels)
    if AUTO in kernels:
        parser.error(f"a band names a kernel, not {AUTO!r}")
    widths = tuple(args.band_widths or BAND_WIDTHS)
    for hidden in widths:
        try:
            check_hidden(hidden, DT)
        except ValueError as exc:
            parser.error(f"--band-widths: {exc}")
    return kernels, widths, tuple(args.band_tokens or BAND_TOKENS)


def main(argv=None):
    ap = OneLineParser(prog="layer-boundary bench cutedsl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--iters", type=positive_int, default=20, help="calls per captured graph")
    ap.add_argument("--repeats", type=positive_int, default=50, help="graph replays timed (median taken)")
    ap.add_argument("--budget-s", type=positive_float, default=270, help="wall-clock budget; flashinfer gets what is left")
    ap.add_argument("--kernel", default="auto",
                    help="the add + RMSNorm kernel timed, by name: auto (a plain call's: chosen by the "
                         "token count), default (the width's tiling at every count), 256x1, 64x2+s+l1+late+g, ...")
    ap.add_argument("--rounds", type=positive_int, default=ROUNDS,
                    help="rounds ours and FlashInfer's are timed in, side by side in one process (ours/fi: medians)")
    ap.add_argument("--buffer-sets", type=positive_int, default=BUFFER_SETS,
                    help="pairs of buffers they are timed on, --rounds rounds each (where buffers sit moves the time)")
    ap.add_argument("--shapes", nargs="+", type=shape, metavar="TxH",
                    help="time only these add + RMSNorm shapes (tokens x hidden, e.g. 1024x4096) and no MoE finalize")
    ap.add_argument("--bands-out", default="", metavar="FILE",
                    help="time the band kernels against the default tiling over the band grid and write the ROWS_BANDS "
                         "table they suggest here (JSON; LAYER_BOUNDARY_CUTEDSL_ADD_NORM_BANDS=FILE makes plain calls use it)")
    ap.add_argument("--band-kernels", nargs="+", metavar="NAME", help=f"with --bands-out: the kernels a band may name ({' '.join(BAND_KERNELS)})")
    ap.add_argument("--band-widths", nargs="+", type=positive_int, metavar="H", help="with --bands-out: the widths (default: 2048 4096 7168 8192)")
    ap.add_argument("--band-tokens", nargs="+", type=positive_int, metavar="T", help="with --bands-out: the token counts")
    ap.add_argument("--flashinfer-child", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    (kernel_options,) = check_candidates(ap, [args.kernel])
    band_kernels, band_widths, band_tokens = check_band_args(ap, args)
    if args.flashinfer_child:
        with open(args.flashinfer_child[0]) as f:
            job = json.load(f)
        status = bench_flashinfer(job["results"], job["iters"], job["repeats"], kernel_options, job["rounds"], job["sets"])
        write(args.flashinfer_child[1], dict(results=job["results"], status=status))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    if args.bands_out:
        iters, repeats = (10, 20) if args.quick else (args.iters, args.repeats)
        payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, iters=iters, repeats=repeats)
        payload.update(measure_bands(band_widths, band_tokens, band_kernels, iters, repeats, args.rounds))
        write(args.bands_out, {str(h): b for h, b in payload["bands"].items()})
        write(args.out, payload)
        print(f"bands (ROWS_BANDS form) written to {args.bands_out}: {payload['bands']}", flush=True)
        return 0
    t_start = time.time()
    iters, repeats = (10, 20) if args.quick else (args.iters, args.repeats)
    torch.cuda.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    meta = dict(
        device=dev.name, sms=dev.multi_processor_count, torch=torch.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), iters=iters, repeats=repeats, add_norm_kernel=args.kernel,
        flashinfer_rounds=args.rounds, flashinfer_buffer_sets=args.buffer_sets,
    )
    try:
        import cutlass

        meta["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception as exc:
        meta["cutlass_dsl"] = f"not importable: {exc}"
    print(f"# {meta}", flush=True)

    copies = copy_bandwidths(iters, repeats)
    copy_gbs = max(copies.values())
    print(f"  device copy of 1 GiB, read + write counted: copy engine {copies['copy_engine']:.0f} GB/s, "
          f"SM kernel {copies['sm_kernel']:.0f} GB/s; baseline {copy_gbs:.0f} GB/s", flush=True)
    meta["copy_gbs"] = copy_gbs
    meta["copy_gbs_by_method"] = copies

    add_cases = [(t, h) for h in (2048, 4096, 7168, 8192) for t in (1, 16, 128, 1024, 8192, 32768)]
    if args.quick:
        add_cases = [(1, 4096), (128, 4096), (1024, 8192), (8192, 4096), (8192, 8192)]
    moe_cases = [(1, 4096), (16, 4096), (128, 4096), (1024, 4096), (4096, 4096), (1024, 7168)]
    if args.quick:
        moe_cases = [(1, 4096), (128, 4096), (4096, 4096)]
    if args.shapes:
        add_cases, moe_cases = args.shapes, []
    results = []
    payload = dict(meta=meta, results=results)
    try:
        bench_add_norm(add_cases, iters, repeats, copy_gbs, results, kernel_options)
        write(args.out, payload)
        bench_moe(moe_cases, 8, iters, repeats, results)
    except Exception:
        traceback.print_exc()
        payload["error"] = traceback.format_exc()
    write(args.out, payload)
    print(table(results), flush=True)
    if not args.no_flashinfer:
        payload["flashinfer"] = flashinfer_in_child(results, iters, repeats, args.budget_s - (time.time() - t_start),
                                                    args.kernel, args.rounds, args.buffer_sets)
        implementations = sorted({r["flashinfer_implementation"] for r in results if "flashinfer_implementation" in r})
        payload["flashinfer_implementation"] = ", ".join(implementations) or None
        write(args.out, payload)
        print(table(results), flush=True)
        print(f"flashinfer: {payload['flashinfer']} (implementation: {payload['flashinfer_implementation']})", flush=True)
        if payload["flashinfer"] != "ok":
            print("FAIL: the FlashInfer comparison did not run (pass --no-flashinfer to skip it on purpose)", flush=True)
            payload["error"] = payload.get("error") or f"flashinfer: {payload['flashinfer']}"
            write(args.out, payload)
    target = [r for r in results if r["kernel"] == "add_rmsnorm" and (r["tokens"], r["hidden"]) == (8192, 4096)]
    if target:
        frac = target[0]["frac_of_copy"]
        print(f"add_rmsnorm 8192x4096: {100 * frac:.1f}% of copy bandwidth (target >= 80%): {'PASS' if frac >= 0.8 else 'BELOW TARGET'}")
    print(f"done in {time.time() - t_start:.0f} s")
    return 1 if "error" in payload else 0


if __name__ == "__main__":
    sys.exit(main())
