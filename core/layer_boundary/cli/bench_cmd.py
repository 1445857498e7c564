"""`layer-boundary bench NAME [--json] [-- options]`: run a benchmark the core or a plugin
registers (`layer_boundary_benchmarks`); results go to benchmarks/results/ (JSON + PNG), or with
`--json` to stdout as one JSON object (the benchmark's tables then go to stderr)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

from .usage import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="run a benchmark (host, compile, decode; cutedsl and fusion with their plugins); JSON + PNG under benchmarks/results/"
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout (tables go to stderr)")
    p.add_argument("name", help="the benchmark: host, compile, decode, or one a plugin registers (`layer-boundary plugins` lists them)")
    p.add_argument(
        "options", nargs=argparse.REMAINDER, help="the benchmark's own options, after --: bench host --json -- --layers 8"
    )
    p.set_defaults(handler=run)


def _split(options: list) -> tuple[list, bool]:
    """(the benchmark's options, --json given): `--json` belongs to `bench` when it comes
    before the `--` that starts the benchmark's options (or where there is no `--`)."""
    ours, theirs = (options[: options.index("--")], options[options.index("--") + 1 :]) if "--" in options else (options, [])
    json_flag = "--json" in ours
    return [o for o in ours if o != "--json"] + theirs, json_flag


def _out_option(options: list) -> str | None:
    for i, opt in enumerate(options):
        if opt == "--out" and i + 1 < len(options):
            return options[i + 1]
        if opt.startswith("--out="):
            return opt.split("=", 1)[1]
    return None


@contextlib.contextmanager
def _stdout_to_stderr():
    """Everything the benchmark prints, its ranks' processes included, goes to stderr, so
    stdout carries only the JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _benchmark(name: str):
    """`main(options)` of the benchmark `name`: the core's own (`layer_boundary.bench`), or one
    a plugin registers (`layer_boundary_benchmarks`)."""
    from .._plugins.manager import get_registry
    from .._plugins.selection import call_record
    from ..bench import CORE_BENCHMARKS

    benches: dict = {}
    for item in get_registry().benchmarks:
        other = benches.setdefault(item.record.command, item)
        if other is not item:
            raise UsageError(f"two plugins register the benchmark {item.record.command!r}: {other.name} and {item.name}")
        if item.record.command in CORE_BENCHMARKS:
            raise UsageError(f"plugin {item.plugin!r} registers the benchmark {item.record.command!r}, which is the core's own; rename it")
    if name in CORE_BENCHMARKS:
        module = CORE_BENCHMARKS[name][0]
        return lambda options: importlib.import_module(module).main(options)
    item = benches.get(name)
    if item is None:
        raise UsageError(
            f"no benchmark {name!r} (the core's: {', '.join(CORE_BENCHMARKS)}; installed plugins': {', '.join(sorted(benches)) or 'none'}); "
            "install the plugin that ships it (the fusion plugins ship theirs)"
        )
    return lambda options: call_record(item, options)


def run(args) -> int:
    main = _benchmark(args.name)
    options, json_flag = _split(list(args.options))
    args.json = args.json or json_flag
    with tempfile.TemporaryDirectory(prefix="layer-boundary-bench-") as tmp:
        out = _out_option(options)
        if args.json and out is None:  # every benchmark writes its JSON to --out: read it back
            out = os.path.join(tmp, f"{args.name}.json")
            options += ["--out", out]
        try:
            with _stdout_to_stderr() if args.json else contextlib.nullcontext():
                status = main(options)
        except SystemExit as exc:
            if exc.code in (None, 0):
                status = 0
            elif isinstance(exc.code, int):  # the benchmark's parser already said why (one line)
                return exc.code
            else:
                raise UsageError(str(exc.code)) from None
        status = status if isinstance(status, int) else 0
        if status:
            return status
        if args.json:
            if not Path(out).is_file():
                raise UsageError(f"bench {args.name} wrote no results to {out}")
            print(json.dumps(json.loads(Path(out).read_text()), indent=2))
    return 0
