"""Row adapters: plugins that must know which token rows a stage's compute input holds.

A stage asks for them by kind with the stage option `publish_rows=("lora",)`. Construction
binds one adapter per kind from the registry (a missing kind names the distribution to
install); after every `prepare()` the stage publishes a `ComputeRows` (layout, row count, and
each adapter's per-row facts on those rows) that compute reads with `get_compute_rows()`.

A bound row adapter is an object with:

- `publish(plan, layout, forward)`: its per-row facts for a compute input in `layout`. It is
  called on every rank of the stage at the same point, so it may run a collective over a group
  whose ranks all run the stage (for example a gather of per-row facts over attention DP);
- `fused_consumer_only` (optional, FFN stages): the FFN's sum may be left to the next input only
  when a fusion provider accepts the batch (`can_defer_all_reduce`);
- `describe(plan, layout)` (optional): a line for `layer-boundary plan`.
"""

from __future__ import annotations

from ._errors import missing_feature
from ._contracts import StageKind
from ._forward import ComputeRows, RowLayout, publish_compute_rows, scoped_compute_rows

__all__ = ["bind_row_adapters", "compute_rows", "publish_rows", "rows_in_scope", "describe_publication"]

OPTION = "publish_rows"


def _kinds(plan) -> tuple[str, ...]:
    raw = plan.options.get(OPTION, ())
    kinds = (raw,) if isinstance(raw, str) else tuple(raw)
    if not all(isinstance(k, str) and k for k in kinds):
        raise TypeError(f"stage {plan.label}: {OPTION} takes adapter kinds, for example ('lora',); got {raw!r}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"stage {plan.label}: {OPTION} names an adapter kind twice: {kinds}")
    return kinds


def bind_row_adapters(plan, registry) -> None:
    """Bind the first accepting adapter of every kind the stage asks for (construction only)."""
    bound = []
    for kind in _kinds(plan):
        adapters = registry.adapters_of(kind)
        if not adapters:
            raise missing_feature(f"the {kind!r} row adapter that stage {plan.label} asks for ({OPTION}=)", kind)
        adapter = next((a for a in (item.record.factory(plan) for item in adapters) if a is not None), None)
        if adapter is None:
            names = ", ".join(item.name for item in adapters)
            raise NotImplementedError(f"stage {plan.label}: no {kind!r} row adapter ({names}) supports this stage")
        bound.append((kind, adapter))
        if plan.kind is StageKind.FFN and getattr(adapter, "fused_consumer_only", False):
            plan.fused_consumer_only = True
    plan.row_adapters = tuple(bound)


def compute_rows(plan, layout: RowLayout, fwd) -> ComputeRows:
    """The publication of `plan`'s compute input in `layout` for this forward."""
    published = {kind: adapter.publish(plan, layout, fwd) for kind, adapter in plan.row_adapters}
    return ComputeRows(stage=plan.label, layout=layout, num_rows=layout.rows(fwd), published=published)


def publish_rows(plan, fwd) -> None:
    """Publish the compute rows of the path `fwd` selects (after `prepare()`)."""
    publish_compute_rows(compute_rows(plan, plan.path_for(fwd).entry.compute_rows, fwd))


def rows_in_scope(plan, layout: RowLayout, fwd):
    """A block that publishes `layout` rows for compute run inside an input move."""
    return scoped_compute_rows(compute_rows(plan, layout, fwd))


def describe_publication(plan, layout: RowLayout) -> str:
    parts = []
    for kind, adapter in plan.row_adapters:
        describe = getattr(adapter, "describe", None)
        parts.append(describe(plan, layout) if describe is not None else kind)
    return f"publish the compute rows ({layout.value}) to {', '.join(parts)}"
