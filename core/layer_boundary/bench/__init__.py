"""The core's benchmarks behind `layer-boundary bench NAME` (plugins register theirs through
`layer_boundary_benchmarks`); each measures against a baseline timed in the same run and writes
its raw results under benchmarks/results/."""

#: command -> (module whose `main(argv)` runs it, description)
CORE_BENCHMARKS = {
    "host": ("layer_boundary.bench.host", "host overhead of a 32-layer stack through the boundaries against the same torch ops by hand"),
    "compile": ("layer_boundary.bench.compile",
                "host time per forward of the 32-layer stack compiled (fullgraph) against eager and the hand-written stack compiled"),
    "decode": ("layer_boundary.bench.decode",
               "decode step time of a model family at a realistic width, eager against CUDA-graph replay, against Hugging Face (GPU)"),
}
