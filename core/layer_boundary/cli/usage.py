"""The command line's error types and exit statuses."""

from __future__ import annotations

__all__ = ["UsageError", "PluginFailure", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_PLUGIN_FAILED", "EXIT_STATUSES"]

#: the run's check failed (its verdict says by how much)
EXIT_CHECK_FAILED = 1
#: bad input: one line naming the fix, before any rank starts
EXIT_BAD_INPUT = 2
#: a plugin failed while the model was built, prepared or run: one line naming the plugin and
#: the switch that disables it (LAYER_BOUNDARY_DISABLE_PLUGINS=<plugin>)
EXIT_PLUGIN_FAILED = 3

#: what `--help` says about them
EXIT_STATUSES = (
    "exit status: 0 the check passed (or --check none); "
    f"{EXIT_CHECK_FAILED} the check failed; "
    f"{EXIT_BAD_INPUT} bad input (one line naming the fix, before any rank starts); "
    f"{EXIT_PLUGIN_FAILED} a plugin failed while the model was built, prepared or run (one line naming the plugin and "
    "LAYER_BOUNDARY_DISABLE_PLUGINS=<plugin>, the switch that runs without it)"
)


class UsageError(Exception):
    """Bad input: printed as one line (a line per problem), exit status 2, before any rank starts."""


class PluginFailure(Exception):
    """A plugin failed at run time (a fusion candidate or kernel raised or returned the wrong
    tensor, a factory raised): printed as one line, exit status 3."""
