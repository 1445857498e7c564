"""Why one add + RMSNorm kernel reads differently in `bench cutedsl` and in the layout sweep
(session 12, H200: FlashInfer's form of the kernel, 64x2 staged, at T=1024 H=4096 in place took
7.0-7.2 us in the bench and 6.0-6.2 us in the sweep; the default kernel 6.45 in both).

In one process, the same two kernels (`KERNELS`) are timed the bench's way
(`bench_add_norm`: new buffers, then in place on clones) and the sweep's way
(`_measure_variants`, in place, rotated rounds), before and after FlashInfer's kernel has run in
the process, and after the bench's 1 GiB copies. A step that moves only one of the two ways
names the cause. Its first run (session 12) moved none: FlashInfer's form read 7.1-7.3 us every
way, where the layout sweeps had read 6.0-6.2. The last step therefore places x and the
residual in one allocation at chosen distances (`OFFSETS` beyond back to back) and times each
kernel and FlashInfer in place there. Its run (session 13, `--offsets-only`) answered it: every
kernel, FlashInfer's too, moves 2-8% with the distance (FlashInfer's 5.85-6.30 us at 0 B-3 MiB),
so where a process's buffers land sets an L2-resident call's time, and `bench cutedsl` now
times ours beside FlashInfer's on the same buffers.

    python benchmarks/add_norm_context_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from layer_boundary_cutedsl.add_norm_sweep import _flashinfer, _measure_variants
from layer_boundary_cutedsl.bench import EPS, bench_add_norm, copy_bandwidths, time_graph
from layer_boundary_cutedsl.kernels import fused_add_rmsnorm
from layer_boundary_cutedsl.kernels.tiling import parse_candidate

#: FlashInfer's form of the kernel at H=4096 and the width's default tiling, each with and
#: without the grid-stride loop (inside one, ptxas gives our cp.async an L2 prefetch hint)
KERNELS = ("64x2+s+l1+late+g", "64x2+s+l1+late+g+nl", "default", "default+nl")
#: bytes between the end of x and the start of the residual in one allocation
OFFSETS = (0, 4096, 65536, 1 << 20, 3 << 20)


def bench_way(tokens: int, hidden: int) -> dict:
    """Each kernel's (in place, new buffers) microseconds, timed as `bench cutedsl` times them."""
    out = {}
    for name in KERNELS:
        rows = []
        bench_add_norm([(tokens, hidden)], 20, 50, 1.0, rows, parse_candidate(name))
        out[name] = dict(in_place=rows[0]["cutedsl_inplace_us"], new_buffers=rows[0]["cutedsl_us"])
    return out


def sweep_way(tokens: int, hidden: int, fi) -> dict:
    variants = [(name, True, parse_candidate(name)) for name in KERNELS]
    row = _measure_variants(tokens, hidden, fi, 20, 50, variants, rounds=3)
    return dict(us=row["us"], flashinfer_us=row.get("flashinfer_us"))


def offset_way(tokens: int, hidden: int, fi) -> dict:
    """Each kernel's and FlashInfer's in-place microseconds with the residual `offset` bytes
    after the end of x, for each of `OFFSETS` (the inputs refilled before each timing)."""
    n = tokens * hidden
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(torch.bfloat16)
    out = {}
    for offset in OFFSETS:
        gap = offset // 2  # elements of bf16
        flat = torch.empty(2 * n + gap, dtype=torch.bfloat16, device="cuda")
        x, r = flat[:n].view(tokens, hidden), flat[n + gap :].view(tokens, hidden)
        runs = {
            name: (lambda x=x, r=r, options=parse_candidate(name): fused_add_rmsnorm(x, r, gamma, EPS, out=x, residual_out=r, **options))
            for name in KERNELS
        }
        if fi is not None:
            runs["flashinfer"] = lambda x=x, r=r: fi(x, r, gamma, EPS)
        times = {}
        for name, run in runs.items():
            x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
            r.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
            times[name] = time_graph(run, 20, 50)
        out[str(offset)] = times
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--offsets-only", action="store_true", help="only the last step (x and the residual at chosen distances)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    t, h = args.tokens, args.hidden
    steps = []

    def step(label, result):
        steps.append(dict(step=label, result=result))
        print(f"{label}: {json.dumps(result)}", flush=True)

    if args.offsets_only:
        fi, error = _flashinfer()
    else:
        step("bench way, first", bench_way(t, h))
        step("sweep way, no flashinfer", sweep_way(t, h, None))
        fi, error = _flashinfer()
        step("sweep way, with flashinfer", sweep_way(t, h, fi))
        step("bench way, after flashinfer ran", bench_way(t, h))
        copy_bandwidths(20, 50)
        step("bench way, after the 1 GiB copies", bench_way(t, h))
        step("sweep way, after the 1 GiB copies", sweep_way(t, h, fi))
    step("in place, the residual OFFSET bytes after x", offset_way(t, h, fi))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(tokens=t, hidden=h, steps=steps, flashinfer_error=error), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
