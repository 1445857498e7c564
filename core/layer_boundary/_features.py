"""Entry points for handoffs a sequential `prepare()` cannot express: two-batch overlap (TBO)
and prepared branches.

The core only names these features; plugins implement them through the extension points
`layer_boundary_overlaps` and `layer_boundary_branches`. Without one, each entry point raises
an error naming the distribution to install. Model code calls these functions and never
imports a plugin.
"""

from __future__ import annotations

import torch

from ._errors import MissingPluginError, missing_feature
from ._plugins.manager import current_registry
from ._plugins.requests import BranchRequest, BranchTransport, Overlap, OverlapRequest
from ._plugins.selection import select

__all__ = ["two_batch_overlap", "branch_input", "branch_output", "merge_branch"]


def _first(point: str, request, what: str, feature: str, capability):
    """The object of the first record of `point` whose factory accepts `request`.

    No record raises `MissingPluginError` naming the distribution; records that all decline
    raise `NotImplementedError`."""
    records = current_registry().records(point)
    if not records:
        raise missing_feature(what, feature)
    chosen = select(point, (request,), records=records, subject=what, check=capability, error_type=TypeError)
    if chosen.chosen is None:
        names = ", ".join(item.name for item in records)
        raise NotImplementedError(f"no installed {feature} provider supports {what} here (tried {names})")
    return chosen.value


#: the overlap scheduler of the current registry, as [registry, overlap]: a plain module list a
#: compiled region reads (and guards on); the selection runs once per registry, outside a trace
_OVERLAP: list = []


@torch._dynamo.assume_constant_result
def _select_overlap() -> bool:
    # inside a compiled region this runs once, while tracing (provider selection is host work)
    registry = current_registry()
    if not (_OVERLAP and _OVERLAP[0] is registry):
        _OVERLAP[:] = [registry, _first("overlaps", OverlapRequest(), "two-batch overlap", "tbo", Overlap)]
    return True


def two_batch_overlap(forward) -> Overlap:
    """The two-batch-overlap scheduler: `.run(stages, hidden_states, forward, ...)` splits this
    batch into two microbatches, interleaves their stages and merges them back. Chosen once per
    registry (every forward gets the same scheduler)."""
    _select_overlap()
    return _OVERLAP[1]


#: the transports found so far, by key: a plain module dict a compiled region reads (and guards on)
_TRANSPORTS: dict = {}


@torch._dynamo.assume_constant_result
def _transport_key(boundary, what: str) -> str:
    # inside a compiled region this runs once, while tracing (provider lookup is host work), and
    # its result is a constant string of the graph; the transport itself is read from _TRANSPORTS
    found = _first("branches", BranchRequest(boundary), what, "branch", BranchTransport)
    key = f"{type(found).__qualname__}@{id(found):x}"
    _TRANSPORTS[key] = found
    return key


def resolve_branch_transport(boundary) -> "BranchTransport | None":
    """The transport a prepared branch enters `boundary` through, found when the boundary is
    built (`StageBoundary`): a compiled region then reads an attribute, where looking it up
    while tracing needs the boundary as a constant, which torch 2.11's Dynamo refuses. None
    when no installed plugin provides one: the call looks again, and raises what is missing."""
    try:
        return _first("branches", BranchRequest(boundary), "prepared branches (branch_input)", "branch", BranchTransport)
    except (MissingPluginError, NotImplementedError):
        return None


def _branches(boundary, what: str) -> BranchTransport:
    found = None if boundary is None else boundary.branch_transport
    if found is not None:
        return found
    return _TRANSPORTS[_transport_key(boundary, what)]


def branch_input(boundary, hidden_states, forward):
    """Enter a prepared branch (a stage declared with `prepared_from=`) from the input its source
    stage already prepared: move that input to the branch's rows and fork the residual stream.

    Returns `(branch_input, branch_forward)`: run the branch's stages on `branch_forward`, which
    carries the branch's own residual stream.
    """
    return _branches(boundary, "prepared branches (branch_input)").branch_input(boundary, hidden_states, forward)


def branch_output(hidden_states, branch_forward):
    """Complete the branch's last contribution on the handoff rows and apply it to the branch's
    residual; releases the branch's stream. Pass the result to `merge_branch()`."""
    return _branches(None, "prepared branches (branch_output)").branch_output(hidden_states, branch_forward)


def merge_branch(hidden_states, branch, forward):
    """Join a `branch_output()` with the main line's output (`hidden_states`, the source stage's
    handle): the main line's contribution stays pending over the branch's residual, so the next
    stage adds it once. Returns the handle the next stage takes."""
    return _branches(None, "prepared branches (merge_branch)").merge_branch(hidden_states, branch, forward)
