"""The deprecated `Adapter` records (`layer_boundary_adapters`), mapped onto the extension
points that replaced them. Each legacy factory keeps receiving what it received before."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import attrs

from ._records import BranchProvider, CpPathProvider, OverlapProvider, Registered, RowPublisher, TokenMappingProvider

__all__ = ["translate_adapters", "LegacySetup", "ModelSetup"]


@attrs.frozen
class ModelSetup:
    """What a deprecated "setup" adapter's factory receives."""

    model: object
    #: the largest token count a forward will have (sizes workspaces)
    max_tokens: int
    #: "prepare" or "release"
    phase: str


@attrs.frozen
class LegacySetup:
    """A "setup" adapter as a participant of the model life cycle."""

    name: str
    factory: Callable[[ModelSetup], Any]

    def prepare(self, request) -> None:
        self.factory(ModelSetup(request.model, request.max_tokens, "prepare"))

    def release(self, request) -> None:
        self.factory(ModelSetup(request.model, 0, "release"))


class _LegacyRows:
    """A legacy row adapter (`publish(plan, layout, forward)`) as a `PublishesRows`."""

    __slots__ = ("adapter", "stage", "fused_consumer_only")

    def __init__(self, adapter, stage):
        self.adapter = adapter
        self.stage = stage
        self.fused_consumer_only = bool(getattr(adapter, "fused_consumer_only", False))

    def publish(self, layout, forward):
        return self.adapter.publish(self.stage, layout, forward)

    def describe(self, layout) -> str:
        describe = getattr(self.adapter, "describe", None)
        return describe(self.stage, layout) if describe is not None else None


def _rows(factory):
    def build(request):
        adapter = factory(request.stage)
        return None if adapter is None else _LegacyRows(adapter, request.stage)

    return build


#: legacy kind -> (registry field, record type, replacement hook, factory adapter)
_KINDS = {
    # a legacy CP adapter received the stage's plan: it now gets the stage's facts (the ordinary
    # path is `request.ordinary` of the new hook), and must return a StagePath of the new form
    "cp": ("cp_paths", CpPathProvider, "layer_boundary_cp_paths", lambda f: lambda r: f(r.stage)),
    "cp_batch": (
        "token_mappings",
        TokenMappingProvider,
        "layer_boundary_token_mappings",
        lambda f: lambda r: f({"parallel": r.parallel, "lengths": r.lengths, "order": r.order, "device": r.device}),
    ),
    "tbo": ("overlaps", OverlapProvider, "layer_boundary_overlaps", lambda f: lambda r: f(r.forward)),
    "branch": ("branches", BranchProvider, "layer_boundary_branches", lambda f: lambda r: f(r.boundary)),
}


def translate_adapters(adapters: list[Registered]) -> tuple[dict[str, list[Registered]], list[LegacySetup]]:
    """The extension-point records (by registry field) and the life-cycle participants the
    deprecated records stand for, warning once per record with its replacement."""
    mapped: dict[str, list[Registered]] = {}
    setups: list[LegacySetup] = []
    for item in sorted(adapters, key=lambda i: (-i.record.priority, i.record.name)):
        record = item.record
        if record.kind == "setup":
            _warn(item, "the life-cycle hooks layer_boundary_prepare_model / layer_boundary_release_model")
            setups.append(LegacySetup(record.name, record.factory))
            continue
        field, rtype, hook, adapt = _KINDS.get(record.kind, (None, None, None, None))
        if field is None:  # a stage asks for it with publish_rows=(kind,)
            field, rtype, hook, adapt = "row_publishers", RowPublisher, "layer_boundary_row_publishers", _rows
            new = rtype(name=record.name, kind=record.kind, factory=adapt(record.factory), priority=record.priority,
                        description=record.description)
        else:
            new = rtype(name=record.name, factory=adapt(record.factory), priority=record.priority, description=record.description)
        _warn(item, f"{rtype.__name__} records from {hook}")
        mapped.setdefault(field, []).append(attrs.evolve(item, record=new))
    return mapped, setups


def _warn(item: Registered, replacement: str) -> None:
    warnings.warn(
        f"plugin {item.plugin!r} (distribution {item.distribution}) registers Adapter {item.name!r} of kind "
        f"{item.record.kind!r} through the deprecated layer_boundary_adapters hook; use {replacement} instead",
        DeprecationWarning,
        stacklevel=2,
    )
