"""Typed registration records (frozen, keyword-only) and the provenance wrapper."""

from __future__ import annotations

import re
from typing import Any, Callable, Generic, Optional, TypeVar

import attrs

_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def _valid_name(instance, attribute, value):
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.name must be a dotted lowercase name prefixed by its plugin "
            f"(for example 'flashinfer.ar_add_rmsnorm'), got {value!r}"
        )


def _callable(instance, attribute, value):
    if not callable(value):
        raise TypeError(f"{type(instance).__name__}.{attribute.name} must be callable, got {value!r}")


class Priority:
    """Priority bands. Higher runs first; ties are broken by name, never by install order."""

    BUILTIN = -1000  #: the core's unfused defaults, always applicable, always last
    REFERENCE = 0  #: pure-torch implementations
    GENERIC = 100
    VENDOR = 200  #: vendor libraries (FlashInfer)
    ARCH_SPECIFIC = 300  #: kernels for one GPU family (CuTe DSL on Hopper)


@attrs.frozen(kw_only=True)
class FusionProvider:
    """A backend that completes deferred work together with the consumer's read.

    `factory(stage: StageDescription)` runs once per stage at construction and returns a
    provider object, or None when the stage is outside what the backend handles. It must not
    import heavy libraries before deciding.
    """

    name: str = attrs.field(validator=_valid_name)
    factory: Callable[[Any], Optional[Any]] = attrs.field(validator=_callable)
    priority: int = 0
    description: str = ""


@attrs.frozen(kw_only=True)
class ResidualKind:
    """Named residual semantics. `factory(**options)` returns a `ResidualOps`."""

    name: str = attrs.field(validator=_valid_name)
    kind: str
    factory: Callable[..., Any] = attrs.field(validator=_callable)
    priority: int = 0
    description: str = ""


@attrs.frozen(kw_only=True)
class Adapter:
    """A row transport of one `kind` ("cp", "tbo", "branch", "lora", ...).

    `factory(request)` returns the adapter object for a stage or a model, or None. Kinds the
    core asks for itself:
    - "cp": `factory(plan)` -> the stage's CP `StagePath` (entry mode "adapter", exit role
      "adapter"), None, or raises `NotImplementedError(reason)` for a stage it cannot carry;
    - "cp_batch": `factory({"parallel", "lengths", "order", "device"})` -> the token mapping
      of a CP batch (`Forward(cp=...)`), used by `layer-boundary run`.
    """

    name: str = attrs.field(validator=_valid_name)
    kind: str
    factory: Callable[[Any], Optional[Any]] = attrs.field(validator=_callable)
    priority: int = 0
    description: str = ""


T = TypeVar("T")


@attrs.frozen
class Registered(Generic[T]):
    """A record with where it came from."""

    record: T
    plugin: str
    distribution: Optional[str]
    version: Optional[str]

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def priority(self) -> int:
        return self.record.priority


def selection_key(item: Registered) -> tuple[int, str]:
    """(-priority, name): a total order, since names are unique."""
    return (-item.record.priority, item.record.name)
