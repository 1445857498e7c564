"""Host overhead of the boundary: a 32-layer stack through the boundaries vs the same torch ops
written by hand, TP=1, eager, tiny hidden (so host time dominates).

Both stacks run interleaved in one process, in rounds that alternate which runs first; the ratio
is the median of the rounds' ratios of thread CPU time (the wall-clock ratio is reported too); the
report gives the ratio, where the boundary's time goes per call site (prepare / finish / exit / final
norm), and the per-call cost of each boundary method measured on its own.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from layer_boundary import Forward, Parallel, RMSNorm, declare_attn, declare_ffn, layer_stack, make_stages, residual_batch
from layer_boundary._options import OneLineParser, positive_int


class Layer(nn.Module):
    def __init__(self, hidden: int, layer_id: int, layers: int, parallel):
        super().__init__()
        self.attn = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Linear(hidden, hidden, bias=False)
        self.n1 = RMSNorm(hidden)
        self.n2 = RMSNorm(hidden)
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(), self.n1),
            (declare_ffn(), self.n2),
            previous=declare_ffn() if layer_id else None,
            terminal=layer_id == layers - 1,
        )


class Stack(nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        parallel = Parallel.single()
        with layer_stack(parallel, reduction="ar"):
            self.layers = nn.ModuleList(Layer(hidden, i, layers, parallel) for i in range(layers))
        self.norm = RMSNorm(hidden)
        self.parallel = parallel

    # the model as an engine writes it with the boundaries ------------------------------------
    def boundary_forward(self, x: torch.Tensor, timers=None, fwd=None) -> torch.Tensor:
        """`fwd`: the batch's Forward, built by the caller (as a compiled engine passes it in);
        built here from the row count when None."""
        if fwd is None:
            fwd = Forward(self.parallel, x.shape[0])
        residual_batch.start(fwd)
        h = x
        for layer in self.layers:
            h = layer.attn_boundary.prepare(h, fwd)
            h = layer.attn_boundary.finish(layer.attn(h), fwd)
            h = layer.ffn_boundary.prepare(h, fwd)
            with layer.ffn_boundary.exit(fwd) as out:
                y = layer.mlp(h)
            h = out.finish(y)
        return residual_batch.norm(h, fwd, self.norm)

    # the same ops by hand (the add + norm an engine calls: the norm's chosen kernel) -----------
    def hand_forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = self.layers[0].n1(x)
        first = True
        for layer in self.layers:
            if not first:
                h, residual = layer.n1.fused_add_forward(h, residual)
            first = False
            h = layer.attn(h)
            h, residual = layer.n2.fused_add_forward(h, residual)
            h = layer.mlp(h)
        h, _ = self.norm.fused_add_forward(h, residual)
        return h


def _median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def per_call_costs(stack: Stack, x: torch.Tensor, repeats: int) -> dict:
    """Each boundary method's own cost (us), the compute replaced by an identity."""
    layer = stack.layers[1]
    fwd = Forward(stack.parallel, x.shape[0])
    out = {}

    def setup_pending():
        residual_batch.start(fwd)
        residual_batch.written(x, fwd)
        h = stack.layers[0].attn_boundary.prepare(fwd.residual_stream.handle, fwd)
        return stack.layers[0].attn_boundary.finish(h, fwd)

    def timed(fn, pre):
        samples = []
        for _ in range(repeats):
            arg = pre()
            start = time.perf_counter_ns()
            fn(arg)
            samples.append((time.perf_counter_ns() - start) / 1e3)
        return statistics.median(samples)

    # prepare of an FFN input: complete nothing (TP=1), fused add + norm
    out["prepare"] = timed(lambda h: stack.layers[0].ffn_boundary.prepare(h, fwd), setup_pending)
    out["add_norm_kernel_only"] = _median_us(lambda: layer.n2.add_forward(x, x), repeats)
    # the same through the norm's chosen kernel (the dispatch's dict lookup included)
    out["add_norm_chosen"] = _median_us(lambda: layer.n2.fused_add_forward(x, x), repeats)
    def ready_for_finish():
        h = setup_pending()
        return stack.layers[0].ffn_boundary.prepare(h, fwd)

    out["finish"] = timed(lambda h: layer.attn_boundary.finish(h, fwd), ready_for_finish)

    def exit_and_finish(h):
        with stack.layers[0].ffn_boundary.exit(fwd) as o:
            pass
        o.finish(h)

    out["exit+finish"] = timed(exit_and_finish, ready_for_finish)
    return out


def interleaved_rounds(ours, theirs, rounds: int, clock=time.thread_time_ns) -> list[tuple[int, int]]:
    """(ours, theirs) times of `rounds` rounds, each running both once, in alternating order
    (ours first, then theirs first), so drift in machine load and the warmth of caches affects
    both alike. The clock is this thread's CPU time by default: on a shared machine, time spent
    descheduled is not host overhead."""
    samples = []
    for i in range(rounds):
        first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        a, b = t1 - t0, t2 - t1
        samples.append((a, b) if i % 2 == 0 else (b, a))
    return samples


def ratio_summary(samples: list[tuple[int, int]]) -> dict:
    """The median of the per-round ratios (each round's pair ran back to back, so a round's ratio
    is the least disturbed by load) with its quartiles, and the medians of each side (us)."""
    ratios = [a / b for a, b in samples]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ours_us": statistics.median(a for a, _ in samples) / 1e3,
        "theirs_us": statistics.median(b for _, b in samples) / 1e3,
    }


def run(layers: int = 32, hidden: int = 64, tokens: int = 4, repeats: int = 600, warmup: int = 30) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    stack = Stack(hidden, layers).eval()
    x = torch.randn(tokens, hidden)
    with torch.inference_mode():
        a, b = stack.boundary_forward(x), stack.hand_forward(x)
        if not torch.equal(a, b):
            raise SystemExit(f"boundary and hand-written stacks differ: max {(a - b).abs().max().item()}")
        for _ in range(warmup):
            stack.boundary_forward(x)
            stack.hand_forward(x)
        gc.collect()
        gc.disable()
        try:
            ours, theirs = (lambda: stack.boundary_forward(x)), (lambda: stack.hand_forward(x))
            cpu = ratio_summary(interleaved_rounds(ours, theirs, repeats))
            wall = ratio_summary(interleaved_rounds(ours, theirs, max(repeats // 3, 5), clock=time.perf_counter_ns))
            calls = per_call_costs(stack, x, repeats)
        finally:
            gc.enable()
        profile = profile_call_sites(stack, x)
    b_us, h_us = cpu["ours_us"], cpu["theirs_us"]
    return {
        "layers": layers,
        "hidden": hidden,
        "tokens": tokens,
        "repeats": repeats,
        "clock": "thread CPU time; ratio = median of per-round ratios, rounds alternating which stack runs first",
        "boundary_us": b_us,
        "hand_us": h_us,
        "ratio": cpu["ratio"],
        "ratio_quartiles": [cpu["ratio_q1"], cpu["ratio_q3"]],
        "wall_ratio": wall["ratio"],
        "wall_ratio_quartiles": [wall["ratio_q1"], wall["ratio_q3"]],
        "overhead_us_per_layer": (b_us - h_us) / layers,
        "per_call_us": calls,
        "profile": profile,
        "torch": torch.__version__,
    }


def profile_call_sites(stack: Stack, x: torch.Tensor, forwards: int = 50) -> list:
    """cProfile of the boundary stack: the functions of layer_boundary by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(forwards):
        stack.boundary_forward(x)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        if "layer_boundary" in path:
            rows.append({"site": f"{Path(path).name}:{line} {name}", "calls_per_forward": nc / forwards, "own_us_per_forward": tt * 1e6 / forwards})
    rows.sort(key=lambda r: -r["own_us_per_forward"])
    return rows[:15]


def main(argv=None) -> dict:
    ap = OneLineParser(prog=f"layer-boundary bench {Path(__file__).stem}", description=__doc__)
    ap.add_argument("--layers", type=positive_int, default=32)
    ap.add_argument("--hidden", type=positive_int, default=64)
    ap.add_argument("--tokens", type=positive_int, default=4)
    ap.add_argument("--repeats", type=positive_int, default=600)
    ap.add_argument("--out", default="benchmarks/results/host.json")
    args = ap.parse_args(argv)
    result = run(args.layers, args.hidden, args.tokens, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"host overhead, {result['layers']} layers, hidden {result['hidden']}, {result['tokens']} tokens, TP=1 eager ({result['repeats']} interleaved rounds)")
    print(f"  boundary stack   {result['boundary_us']:9.1f} us/forward (CPU)")
    print(f"  hand-written     {result['hand_us']:9.1f} us/forward (CPU)")
    q1, q3 = result["ratio_quartiles"]
    print(f"  ratio            {result['ratio']:9.3f}   (quartiles {q1:.3f}-{q3:.3f}; {result['overhead_us_per_layer']:.2f} us/layer)")
    print(f"  wall-clock ratio {result['wall_ratio']:9.3f}")
    for k, v in result["per_call_us"].items():
        print(f"  {k:<22} {v:7.2f} us/call")
    print("  boundary call sites (own time per forward):")
    for row in result["profile"][:8]:
        print(f"    {row['own_us_per_forward']:8.1f} us  {row['calls_per_forward']:5.0f} calls  {row['site']}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
