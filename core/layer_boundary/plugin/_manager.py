"""Loading plugins and building the registry, once per process.

Policy:
- built-in defaults register through the same hooks as every plugin, ranked last;
- entry points of group `layer_boundary` load in name order; one that fails to import is
  reported and skipped (or raised with `LAYER_BOUNDARY_STRICT_PLUGINS=1`);
- `LAYER_BOUNDARY_DISABLE_PLUGINS=a,b` switches plugins off by entry-point name;
- two records with one name are an error naming both distributions;
- records are ordered by (-priority, name).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
import logging
import os
from typing import Iterable, Optional

import attrs
import pluggy

from ._hookspecs import PROJECT, LayerBoundarySpecs
from ._records import Adapter, FusionProvider, Registered, ResidualKind, selection_key

log = logging.getLogger("layer_boundary.plugins")

ENTRY_POINT_GROUP = "layer_boundary"
BUILTIN_PLUGINS = (("core", "layer_boundary._builtin.plugin"),)
STRICT_ENV = "LAYER_BOUNDARY_STRICT_PLUGINS"
DISABLE_ENV = "LAYER_BOUNDARY_DISABLE_PLUGINS"

HOOKS = {
    "fusion_providers": ("layer_boundary_fusion_providers", FusionProvider),
    "residual_kinds": ("layer_boundary_residual_kinds", ResidualKind),
    "adapters": ("layer_boundary_adapters", Adapter),
}


class PluginError(RuntimeError):
    """A plugin broke the registry's rules (duplicate names, bad records, a raising hook)."""


class PluginLoadError(PluginError):
    """A plugin failed to import in strict mode."""


@attrs.frozen
class LoadReport:
    """What happened to one plugin."""

    name: str
    distribution: Optional[str]
    version: Optional[str]
    status: str  # "ok", "disabled", "failed: <reason>"
    builtin: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@attrs.frozen
class Registry:
    """Every record per hook, in selection order, and the load report."""

    fusion_providers: tuple[Registered, ...]
    residual_kinds: tuple[Registered, ...]
    adapters: tuple[Registered, ...]
    plugins: tuple[LoadReport, ...]

    def records(self, hook: str) -> tuple[Registered, ...]:
        return getattr(self, hook)

    def adapters_of(self, kind: str) -> tuple[Registered, ...]:
        return tuple(r for r in self.adapters if r.record.kind == kind)

    def residual_kinds_of(self, kind: str) -> tuple[Registered, ...]:
        return tuple(r for r in self.residual_kinds if r.record.kind == kind)

    def plugin(self, name: str) -> Optional[LoadReport]:
        return next((p for p in self.plugins if p.name == name), None)

    def fingerprint(self) -> tuple[str, ...]:
        """Names of every record in order: equal on every rank that loaded the same plugins."""
        return tuple(r.name for hook in HOOKS for r in self.records(hook))


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def get_plugin_manager() -> tuple[pluggy.PluginManager, tuple[LoadReport, ...], dict[str, tuple[Optional[str], Optional[str]]]]:
    """The process's plugin manager, the load report and each plugin's (distribution, version)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(LayerBoundarySpecs)
    reports: list[LoadReport] = []
    provenance: dict[str, tuple[Optional[str], Optional[str]]] = {}
    disabled = _disabled()
    strict = _strict()
    core_version = _version_of("layer-boundary")
    for name, module in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module), name=name)
        provenance[name] = ("layer-boundary", core_version)
        reports.append(LoadReport(name, "layer-boundary", core_version, "ok", builtin=True))
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        if ep.name in seen:
            continue  # the same distribution visible twice on sys.path
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        if ep.name in disabled:
            reports.append(LoadReport(ep.name, dist, version, "disabled"))
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # noqa: BLE001 - any import failure of an optional plugin
            reason = f"{type(exc).__name__}: {exc}"
            if strict:
                raise PluginLoadError(
                    f"plugin {ep.name!r} (distribution {dist}) failed to load: {reason}; "
                    f"fix or uninstall it, or set {DISABLE_ENV}={ep.name}"
                ) from exc
            log.warning("plugin %r (distribution %s) failed to load and is skipped: %s", ep.name, dist, reason)
            reports.append(LoadReport(ep.name, dist, version, f"failed: {reason}"))
            continue
        provenance[ep.name] = (dist, version)
        reports.append(LoadReport(ep.name, dist, version, "ok"))
    return pm, tuple(reports), provenance


def _version_of(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _collect(pm: pluggy.PluginManager, provenance, hook_name: str, record_type) -> tuple[Registered, ...]:
    out: list[Registered] = []
    by_name: dict[str, Registered] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        dist, version = provenance.get(impl.plugin_name, (None, None))
        try:
            records: Iterable = impl.function() or ()
            records = list(records)
        except Exception as exc:
            raise PluginError(
                f"plugin {impl.plugin_name!r} (distribution {dist}) raised in {hook_name}: {type(exc).__name__}: {exc}; "
                f"set {DISABLE_ENV}={impl.plugin_name} to run without it"
            ) from exc
        for record in records:
            if not isinstance(record, record_type):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} (distribution {dist}) yielded {type(record).__name__} from "
                    f"{hook_name}; expected {record_type.__name__}"
                )
            item = Registered(record, impl.plugin_name, dist, version)
            if record.name in by_name:
                other = by_name[record.name]
                raise PluginError(
                    f"two plugins register the {record_type.__name__} {record.name!r}: "
                    f"{other.plugin!r} (distribution {other.distribution}) and {impl.plugin_name!r} "
                    f"(distribution {dist}); uninstall one or set {DISABLE_ENV}"
                )
            by_name[record.name] = item
            out.append(item)
    return tuple(sorted(out, key=selection_key))


@functools.lru_cache(maxsize=None)
def get_registry() -> Registry:
    """The registry of this process (cached; `reset_registry()` forgets it)."""
    pm, reports, provenance = get_plugin_manager()
    collected = {key: _collect(pm, provenance, hook, rtype) for key, (hook, rtype) in HOOKS.items()}
    return Registry(plugins=tuple(sorted(reports, key=lambda r: (not r.builtin, r.name))), **collected)


def reset_registry() -> None:
    """Forget the cached manager and registry (tests; after installing a plugin)."""
    get_registry.cache_clear()
    get_plugin_manager.cache_clear()
