"""`layer-boundary bench NAME [options]`: run a benchmark; results go to benchmarks/results/."""

from __future__ import annotations

import importlib

from .main import UsageError

#: bench name -> (module, distribution that ships it)
BENCHES = {
    "host": ("layer_boundary.bench.host", "layer-boundary"),
    "decode": ("layer_boundary.bench.decode", "layer-boundary"),
    "cutedsl": ("layer_boundary_cutedsl.bench", "layer-boundary-cutedsl"),
    "fusion": ("layer_boundary_flashinfer.bench", "layer-boundary-flashinfer"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (host, decode, cutedsl, fusion); JSON + PNG under benchmarks/results/")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("options", nargs="*", help="options passed to the benchmark (after --)")
    p.set_defaults(handler=run)


def run(args) -> int:
    module, dist = BENCHES[args.name]
    try:
        bench = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise UsageError(f"bench {args.name} comes with {dist}: pip install {dist}") from None
        raise
    try:
        bench.main(args.options)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise UsageError(str(exc.code)) from None
    return 0
