"""Row publishers: plugins that must know which token rows a stage's compute input holds.

A stage asks for them by kind with the stage option `publish_rows=("lora",)`. Planning binds
one publisher per kind from the registry (a missing kind names the distribution to install);
after every `prepare()` the stage publishes a `ComputeRows` (layout, row count, and each
publisher's per-row facts on those rows) that compute reads with `get_compute_rows()`.
"""

from __future__ import annotations

from ._contracts import StageKind
from ._errors import missing_feature
from ._forward import ComputeRows, RowLayout, publish_compute_rows, scoped_compute_rows
from ._plugins.requests import PublishesRows, RowPublisherRequest
from ._plugins.selection import select

__all__ = ["bind_row_publishers", "compute_rows", "publish_rows", "rows_in_scope", "describe_publication"]

OPTION = "publish_rows"


def _kinds(stage) -> tuple[str, ...]:
    raw = stage.options.get(OPTION, ())
    kinds = (raw,) if isinstance(raw, str) else tuple(raw)
    if not all(isinstance(k, str) and k for k in kinds):
        raise TypeError(f"stage {stage.label}: {OPTION} takes adapter kinds, for example ('lora',); got {raw!r}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"stage {stage.label}: {OPTION} names an adapter kind twice: {kinds}")
    return kinds


def bind_row_publishers(stage, registry) -> tuple[tuple, bool]:
    """((kind, publisher) pairs, fused_consumer_only): the first accepting publisher of every
    kind the stage asks for (construction only)."""
    bound = []
    fused_only = False
    request = RowPublisherRequest(stage)
    for kind in _kinds(stage):
        records = registry.row_publishers_of(kind)
        if not records:
            raise missing_feature(f"the {kind!r} row adapter that stage {stage.label} asks for ({OPTION}=)", kind)
        chosen = select("row_publishers", (request,), records=records, subject=f"planning stage {stage.label}",
                        check=PublishesRows, error_type=TypeError, label=stage.label)
        publisher = chosen.value
        if publisher is None:
            reasons = "; ".join(f"{a.candidate}: {a.reason}" for a in chosen.declined)
            raise NotImplementedError(f"stage {stage.label}: no {kind!r} row adapter supports this stage ({reasons})")
        bound.append((kind, publisher))
        if stage.kind is StageKind.FFN and getattr(publisher, "fused_consumer_only", False):
            fused_only = True
    return tuple(bound), fused_only


def compute_rows(label: str, publishers, layout: RowLayout, fwd) -> ComputeRows:
    """The publication of a compute input in `layout` for this forward."""
    published = {kind: publisher.publish(layout, fwd) for kind, publisher in publishers}
    return ComputeRows(stage=label, layout=layout, num_rows=layout.rows(fwd), published=published)


def publish_rows(plan, fwd) -> None:
    """Publish the compute rows of the path `fwd` selects (after `prepare()`)."""
    publish_compute_rows(compute_rows(plan.label, plan.row_publishers, plan.path_for(fwd).entry.compute_rows, fwd))


def rows_in_scope(label: str, publishers, layout: RowLayout, fwd):
    """A block that publishes `layout` rows for compute run inside an input move."""
    return scoped_compute_rows(compute_rows(label, publishers, layout, fwd))


def describe_publication(plan, layout: RowLayout) -> str:
    parts = []
    for kind, publisher in plan.row_publishers:
        describe = getattr(publisher, "describe", None)
        line = describe(layout) if describe is not None else None
        parts.append(line or kind)
    return f"publish the compute rows ({layout.value}) to {', '.join(parts)}"
