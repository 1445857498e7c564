"""`layer-boundary bench NAME [options]`: run a benchmark the core or a plugin registers
(`layer_boundary_benchmarks`); results go to benchmarks/results/."""

from __future__ import annotations

from .main import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="run a benchmark (host, compile, decode; cutedsl and fusion with their plugins); JSON + PNG under benchmarks/results/"
    )
    p.add_argument("name", help="the benchmark's command (`layer-boundary plugins` lists them)")
    p.add_argument("options", nargs="*", help="options passed to the benchmark (after --)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from ..plugin._manager import get_registry

    benches: dict = {}
    for item in get_registry().benchmarks:
        other = benches.setdefault(item.record.command, item)
        if other is not item:
            raise UsageError(f"two plugins register the benchmark {item.record.command!r}: {other.name} and {item.name}")
    item = benches.get(args.name)
    if item is None:
        raise UsageError(
            f"no installed plugin registers the benchmark {args.name!r} (installed: {', '.join(sorted(benches))}); "
            "install the plugin that ships it (the fusion plugins ship theirs)"
        )
    try:
        item.record.factory(list(args.options))
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise UsageError(str(exc.code)) from None
    return 0
