"""The plugin registry: pluggy hooks that yield typed records, ordered by priority."""

from ._hookspecs import PROJECT, hookimpl, hookspec
from ._manager import (
    ENTRY_POINT_GROUP,
    LoadReport,
    PluginError,
    PluginLoadError,
    Registry,
    get_plugin_manager,
    get_registry,
    reset_registry,
)
from ._records import (
    Adapter,
    FusionProvider,
    Priority,
    Registered,
    ResidualKind,
)

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "hookimpl",
    "hookspec",
    "Adapter",
    "FusionProvider",
    "ResidualKind",
    "Registered",
    "Priority",
    "Registry",
    "LoadReport",
    "PluginError",
    "PluginLoadError",
    "get_plugin_manager",
    "get_registry",
    "reset_registry",
]
