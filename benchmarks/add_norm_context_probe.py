"""Why one add + RMSNorm kernel reads differently in `bench cutedsl` and in the layout sweep
(session 12, H200: FlashInfer's form of the kernel, 64x2 staged, at T=1024 H=4096 in place took
7.0-7.2 us in the bench and 6.0-6.2 us in the sweep; the default kernel 6.45 in both).

In one process, the same two kernels (`auto` and `default`) are timed the bench's way
(`bench_add_norm`: new buffers, then in place on clones) and the sweep's way
(`_measure_variants`, in place, rotated rounds), before and after FlashInfer's kernel has run in
the process, and after the bench's 1 GiB copies. A step that moves only one of the two ways
names the cause.

    python benchmarks/add_norm_context_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from layer_boundary_cutedsl.add_norm_sweep import _flashinfer, _measure_variants
from layer_boundary_cutedsl.bench import bench_add_norm, copy_bandwidths
from layer_boundary_cutedsl.kernels.tiling import parse_candidate

KERNELS = ("auto", "default")


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    t, h = args.tokens, args.hidden
    steps = []

    def step(label, result):
        steps.append(dict(step=label, result=result))
        print(f"{label}: {json.dumps(result)}", flush=True)

    step("bench way, first", bench_way(t, h))
    step("sweep way, no flashinfer", sweep_way(t, h, None))
    fi, error = _flashinfer()
    step("sweep way, with flashinfer", sweep_way(t, h, fi))
    step("bench way, after flashinfer ran", bench_way(t, h))
    copy_bandwidths(20, 50)
    step("bench way, after the 1 GiB copies", bench_way(t, h))
    step("sweep way, after the 1 GiB copies", sweep_way(t, h, fi))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(tokens=t, hidden=h, steps=steps, flashinfer_error=error), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
