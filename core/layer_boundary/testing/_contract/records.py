"""Finding a record (by object or registered name) and the static rules every record keeps."""

from __future__ import annotations

import inspect
import re
from typing import Any, Optional

from ..._plugins.manager import HOOKS, get_registry
from ..._plugins.records import FusionProvider, Priority, Registered, ResidualKind
from .report import ContractReport

#: what each record type is called in reports (by registry field); records other than fusion
#: providers and residual kinds get the record rules only
KINDS = {t: re.sub(r"(?<!^)(?=[A-Z])", " ", t.__name__).lower() for t in [t for _, t in HOOKS.values()]}


def registered_entries(registry) -> tuple[Registered, ...]:
    """Every registered record, extension point by extension point."""
    return tuple(item for key in HOOKS for item in registry.records(key))


def resolve(ref) -> tuple[Any, Optional[Registered]]:
    """(record, its registry entry or None) for a record, a `Registered` or a registered name."""
    if isinstance(ref, Registered):
        return ref.record, ref
    entries = registered_entries(get_registry())
    if isinstance(ref, str):
        for item in entries:
            if item.name == ref:
                return item.record, item
        names = ", ".join(item.name for item in entries)
        raise LookupError(f"no record named {ref!r} is registered (registered: {names}); install the plugin or pass "
                          "the record itself")
    if type(ref) not in KINDS:
        raise TypeError(f"expected a record (FusionProvider, ResidualKind, ...) or its name, got {type(ref).__name__}")
    return ref, next((item for item in entries if item.record is ref), None)


def kind_of(record) -> str:
    return KINDS[type(record)]


def check_record(record, registered: Optional[Registered], report: ContractReport) -> None:
    builtin = registered is not None and registered.plugin == "core"
    if registered is not None and not record.name.startswith(registered.plugin + "."):
        report.add("record", f"name {record.name!r} must start with its plugin's entry-point name {registered.plugin!r}")
    if not isinstance(record.priority, int) or isinstance(record.priority, bool):
        report.add("record", f"priority must be an int, got {record.priority!r}")
    elif not builtin and record.priority <= Priority.BUILTIN:
        report.add("record", f"priority {record.priority} is in the built-in band (<= {Priority.BUILTIN}): the core's "
                             "never-declining candidate would always run first; use Priority.REFERENCE or above")
    if not record.description.strip():
        report.add("record", "description is empty; `layer-boundary plugins` shows it to users")
    if not isinstance(record, ResidualKind):
        try:
            inspect.signature(record.factory).bind(None)
        except TypeError:
            what = "the stage description" if isinstance(record, FusionProvider) else "its typed request"
            report.add("record", f"factory must take exactly one argument, {what}")
        except ValueError:  # builtins without a signature
            pass
    if hasattr(record, "kind") and not (isinstance(record.kind, str) and record.kind):
        report.add("record", f"kind must be a non-empty string, got {record.kind!r}")
    report.stats["records_checked"] += 1
