"""Entry points for handoffs a sequential `prepare()` cannot express: two-batch overlap (TBO)
and prepared branches.

The core only names these features. Adapters of kind "tbo" and "branch", registered by a plugin
(the `layer-boundary-tbo` distribution), implement them; without one, each entry point raises an
error naming the distribution to install. Model code calls these functions and never imports
the plugin.
"""

from __future__ import annotations

from typing import Any

from ._errors import missing_feature
from .plugin._manager import get_registry

__all__ = ["adapter_for", "two_batch_overlap", "branch_input", "branch_output", "merge_branch"]


def adapter_for(kind: str, request: Any, what: str):
    """The first registered adapter of `kind` whose factory accepts `request` (by priority).

    No registered adapter of that kind raises `MissingPluginError` naming the distribution;
    registered adapters that all decline raise `NotImplementedError`.
    """
    items = get_registry().adapters_of(kind)
    if not items:
        raise missing_feature(what, kind)
    for item in items:
        adapter = item.record.factory(request)
        if adapter is not None:
            return adapter
    names = ", ".join(item.name for item in items)
    raise NotImplementedError(f"no installed {kind} adapter supports {what} here (tried {names})")


def two_batch_overlap(forward):
    """The two-batch-overlap adapter for this batch: `.run(stages, hidden_states, forward, ...)`
    splits the batch into two microbatches, interleaves their stages and merges them back."""
    return adapter_for("tbo", forward, "two-batch overlap")


def branch_input(boundary, hidden_states, forward):
    """Enter a prepared branch (a stage declared with `prepared_from=`) from the input its source
    stage already prepared: move that input to the branch's rows and fork the residual stream.

    Returns `(branch_input, branch_forward)`: run the branch's stages on `branch_forward`, which
    carries the branch's own residual stream.
    """
    return adapter_for("branch", boundary, "prepared branches (branch_input)").branch_input(boundary, hidden_states, forward)


def branch_output(hidden_states, branch_forward):
    """Complete the branch's last contribution on the handoff rows and apply it to the branch's
    residual; releases the branch's stream. Pass the result to `merge_branch()`."""
    return adapter_for("branch", None, "prepared branches (branch_output)").branch_output(hidden_states, branch_forward)


def merge_branch(hidden_states, branch, forward):
    """Join a `branch_output()` with the main line's output (`hidden_states`, the source stage's
    handle): the main line's contribution stays pending over the branch's residual, so the next
    stage adds it once. Returns the handle the next stage takes."""
    return adapter_for("branch", None, "prepared branches (merge_branch)").merge_branch(hidden_states, branch, forward)
