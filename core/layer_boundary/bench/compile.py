"""Host time per forward of the `bench host` stack (32 layers, hidden 64, TP=1, CPU): through the
boundaries eager, through the boundaries compiled (`torch.compile(fullgraph=True)`), and the same
torch ops written by hand and compiled with the same backend.

Tiny hidden, so host time dominates: compiling removes the boundary's Python work from the step
(what is left is the graph's own call), and the hand-written stack compiled is the floor. One
intra-op thread; the three run interleaved (median of many forwards) at each token count.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from .host import Stack

__all__ = ["run", "main"]


def _once_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def run(layers: int = 32, hidden: int = 64, tokens=(1, 4, 16, 64), repeats: int = 200, backend: str = "inductor") -> dict:
    from ..compiling import CountingBackend, graph_breaks, reset_graph_breaks

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    reset_graph_breaks()
    stack = Stack(hidden, layers).eval()
    boundary_backend, hand_backend = CountingBackend(backend), CountingBackend(backend)
    boundary_compiled = torch.compile(stack.boundary_forward, backend=boundary_backend, fullgraph=True)
    hand_compiled = torch.compile(stack.hand_forward, backend=hand_backend, fullgraph=True)
    rows = []
    try:
        with torch.inference_mode():
            for count in tokens:
                x = torch.randn(count, hidden)
                start = time.perf_counter()
                outs = (stack.boundary_forward(x), boundary_compiled(x), hand_compiled(x))
                compile_s = time.perf_counter() - start
                agree = max((outs[0] - o).abs().max().item() for o in outs[1:])
                for _ in range(max(10, repeats // 10)):  # warm-up
                    boundary_compiled(x), hand_compiled(x), stack.boundary_forward(x)
                gc.collect()
                gc.disable()
                try:
                    eager, compiled, hand = [], [], []
                    for _ in range(repeats):  # interleaved so all three see the same machine state
                        eager.append(_once_us(lambda: stack.boundary_forward(x)))
                        compiled.append(_once_us(lambda: boundary_compiled(x)))
                        hand.append(_once_us(lambda: hand_compiled(x)))
                finally:
                    gc.enable()
                rows.append({
                    "tokens": count,
                    "eager_us": statistics.median(eager),
                    "compiled_us": statistics.median(compiled),
                    "hand_compiled_us": statistics.median(hand),
                    "first_calls_s": compile_s,
                    "max_abs_diff": agree,
                })
    finally:
        torch.set_num_threads(threads)
    return {
        "layers": layers,
        "hidden": hidden,
        "backend": backend,
        "repeats": repeats,
        "rows": rows,
        "graphs": {"boundary": boundary_backend.graphs, "hand": hand_backend.graphs},
        "graph_breaks": graph_breaks(),
        "torch": torch.__version__,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", default="1,4,16,64", help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend for both compiled stacks (inductor, aot_eager, eager)")
    ap.add_argument("--out", default="benchmarks/results/compile.json")
    args = ap.parse_args(argv)
    tokens = tuple(int(t) for t in args.tokens.split(","))
    result = run(args.layers, args.hidden, tokens, args.repeats, args.backend)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"host time per forward, {result['layers']} layers, hidden {result['hidden']}, TP=1 CPU, backend {result['backend']} "
          f"(median of {result['repeats']}; graphs {result['graphs']}, graph breaks {result['graph_breaks']})")
    print(f"  {'tokens':>6} {'eager':>10} {'compiled':>10} {'hand+compile':>13} {'max diff':>9}")
    for r in result["rows"]:
        print(f"  {r['tokens']:>6} {r['eager_us']:>8.1f}us {r['compiled_us']:>8.1f}us {r['hand_compiled_us']:>11.1f}us {r['max_abs_diff']:>9.1e}")
    from .._timing import line_plot

    xs = [r["tokens"] for r in result["rows"]]
    print(line_plot(
        str(Path(args.out).with_suffix(".png")), f"host time per forward ({result['layers']} layers, {result['backend']})",
        "tokens", "us per forward",
        {
            "boundaries, eager": (xs, [r["eager_us"] for r in result["rows"]]),
            "boundaries, compiled": (xs, [r["compiled_us"] for r in result["rows"]]),
            "hand-written, compiled": (xs, [r["hand_compiled_us"] for r in result["rows"]]),
        },
    ))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
