"""`layer-boundary` (and `python -m layer_boundary`): plugins, run, plan, bench.

Bad input exits with status 2 and one line naming the fix, never a traceback; a plugin that
fails at run time exits with status 3 and one line naming it (`usage.EXIT_STATUSES`).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .usage import EXIT_BAD_INPUT, EXIT_PLUGIN_FAILED, PluginFailure, UsageError

__all__ = ["main", "UsageError", "PluginFailure"]


def _parser():
    from . import plugins_cmd
    from .._options import OneLineParser

    parser = OneLineParser(
        prog="layer-boundary",
        description="Layer boundaries for tensor-parallel transformer inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins_cmd.add_parser(sub)
    for module in _optional_commands():
        module.add_parser(sub)
    return parser


def _optional_commands():
    """The subcommands beside `plugins`."""
    from . import bench_cmd, plan_cmd, run_cmd

    return (run_cmd, plan_cmd, bench_cmd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (UsageError, PluginFailure) as exc:
        for line in str(exc).splitlines() or [""]:  # several problems: one line each
            print(f"layer-boundary {args.command}: error: {line}", file=sys.stderr)
        return EXIT_PLUGIN_FAILED if isinstance(exc, PluginFailure) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
