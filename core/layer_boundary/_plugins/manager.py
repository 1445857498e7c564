"""Loading plugins and building the registry, once per process.

Policy:
- the built-in plugin "core" registers through the same hooks as every plugin, ranked last;
- entry points of group `layer_boundary` load in name order; one that fails to import, or that
  implements a hook no spec declares (a misspelled name), is reported and skipped, or raised
  with `LAYER_BOUNDARY_STRICT_PLUGINS=1`;
- a plugin that registers but breaks the hooks' rules (an implementation taking an argument
  its spec lacks, a raising hook, a wrong record type, two records with one name) is an error:
  it is never skipped silently;
- `LAYER_BOUNDARY_DISABLE_PLUGINS=a,b` switches plugins off by entry-point name;
- inline plugins (`register_inline`: tests, source checkouts) go through the same checks and
  survive `reset_registry()`;
- records are ordered by (-priority, name).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata as metadata
import logging
from typing import Any, Iterable, Iterator, Optional

import attrs
import pluggy

from .._env import env_flag, env_names
from .hookspecs import PROJECT, LayerBoundarySpecs
from . import records as rec
from .records import Registered, selection_key

log = logging.getLogger("layer_boundary.plugins")

ENTRY_POINT_GROUP = "layer_boundary"
#: (name, module) of the built-in plugins, added by the modules themselves (`add_builtin`) so
#: that this module imports none of the library it serves
BUILTIN_PLUGINS: list = []
STRICT_ENV = "LAYER_BOUNDARY_STRICT_PLUGINS"
DISABLE_ENV = "LAYER_BOUNDARY_DISABLE_PLUGINS"

#: registry field -> (hook, record type), in the order `layer-boundary plugins` lists them
HOOKS = {
    "fusion_providers": ("layer_boundary_fusion_providers", rec.FusionProvider),
    "residual_kinds": ("layer_boundary_residual_kinds", rec.ResidualKind),
    "cp_paths": ("layer_boundary_cp_paths", rec.CpPathProvider),
    "token_mappings": ("layer_boundary_token_mappings", rec.TokenMappingProvider),
    "overlaps": ("layer_boundary_overlaps", rec.OverlapProvider),
    "branches": ("layer_boundary_branches", rec.BranchProvider),
    "row_publishers": ("layer_boundary_row_publishers", rec.RowPublisher),
    "add_norm_kernels": ("layer_boundary_add_norm_kernels", rec.AddNormKernel),
    "rope_kernels": ("layer_boundary_rope_kernels", rec.RopeKernel),
    "qk_norm_rope_kernels": ("layer_boundary_qk_norm_rope_kernels", rec.QKNormRopeKernel),
    "decode_attention_kernels": ("layer_boundary_decode_attention_kernels", rec.DecodeAttentionKernel),
    "gated_activation_kernels": ("layer_boundary_gated_activation_kernels", rec.GatedActivationKernel),
    "benchmarks": ("layer_boundary_benchmarks", rec.Benchmark),
    "model_families": ("layer_boundary_model_families", rec.ModelFamily),
}
LIFECYCLE_HOOKS = ("layer_boundary_prepare_model", "layer_boundary_release_model")


class PluginError(RuntimeError):
    """A plugin broke the registry's rules (duplicate names, bad records, a raising hook, an
    implementation that does not match its hook)."""


class PluginLoadError(PluginError):
    """A plugin failed to load (import error, unknown hook) in strict mode."""


@attrs.frozen
class LoadReport:
    """What happened to one plugin."""

    name: str
    distribution: Optional[str]
    version: Optional[str]
    status: str  #: "ok", "disabled", "failed: <reason>"
    builtin: bool = False
    inline: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@attrs.frozen
class Registry:
    """Every record per extension point, in selection order, and the load report."""

    fusion_providers: tuple[Registered, ...]
    residual_kinds: tuple[Registered, ...]
    cp_paths: tuple[Registered, ...]
    token_mappings: tuple[Registered, ...]
    overlaps: tuple[Registered, ...]
    branches: tuple[Registered, ...]
    row_publishers: tuple[Registered, ...]
    add_norm_kernels: tuple[Registered, ...]
    rope_kernels: tuple[Registered, ...]
    qk_norm_rope_kernels: tuple[Registered, ...]
    decode_attention_kernels: tuple[Registered, ...]
    gated_activation_kernels: tuple[Registered, ...]
    benchmarks: tuple[Registered, ...]
    model_families: tuple[Registered, ...]
    #: (plugin, `call(request)`) of the life-cycle hooks, in the order they run
    prepare_hooks: tuple[tuple[str, Any], ...]
    release_hooks: tuple[tuple[str, Any], ...]
    plugins: tuple[LoadReport, ...]

    def records(self, hook: str) -> tuple[Registered, ...]:
        return getattr(self, hook)

    def residual_kinds_of(self, kind: str) -> tuple[Registered, ...]:
        return tuple(r for r in self.residual_kinds if r.record.kind == kind)

    def row_publishers_of(self, kind: str) -> tuple[Registered, ...]:
        return tuple(r for r in self.row_publishers if r.record.kind == kind)

    def families_of(self, model: str) -> tuple[Registered, ...]:
        return tuple(r for r in self.model_families if r.record.model == model)

    def plugin(self, name: str) -> Optional[LoadReport]:
        return next((p for p in self.plugins if p.name == name), None)

    def fingerprint(self) -> tuple[str, ...]:
        """Names of every record in order: equal on every rank that loaded the same plugins."""
        return tuple(r.name for hook in HOOKS for r in self.records(hook))


def disabled_plugins() -> frozenset[str]:
    """The plugin names `LAYER_BOUNDARY_DISABLE_PLUGINS` switches off."""
    return env_names(DISABLE_ENV)


def _strict() -> bool:
    return env_flag(STRICT_ENV)


def _version_of(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# the process's plugins -------------------------------------------------------------------------


@attrs.frozen
class _Inline:
    plugin: Any
    distribution: Optional[str]
    version: Optional[str]


#: inline registrations by name, in registration order; they outlive `reset_registry()`
_INLINE: dict[str, _Inline] = {}


class _Plugins:
    """The pluggy manager of this process, what happened to each plugin, and provenance."""

    def __init__(self):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(LayerBoundarySpecs)
        self.reports: list[LoadReport] = []
        self.provenance: dict[str, tuple[Optional[str], Optional[str]]] = {}

    def register(self, plugin, name: str, dist: Optional[str], version: Optional[str], *, strict: bool, **flags) -> bool:
        """Register `plugin`; False (reported, or raised when strict) when it names a hook no
        spec declares. A registration that breaks a spec raises `PluginError`."""
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {name!r} (distribution {dist}) does not match the hooks' rules: {exc}; fix it, or set "
                f"{DISABLE_ENV}={name} to run without it"
            ) from exc
        unknown = sorted(c.name for c in self.pm.get_hookcallers(plugin) or () if not c.has_spec())
        if unknown:
            self.pm.unregister(plugin)
            self.fail(name, dist, version, f"unknown hook {_unknown(unknown)}", strict=strict, **flags)
            return False
        self.provenance[name] = (dist, version)
        self.reports.append(LoadReport(name, dist, version, "ok", **flags))
        return True

    def fail(self, name: str, dist: Optional[str], version: Optional[str], reason: str, *, strict: bool, cause=None, **flags):
        if strict:
            raise PluginLoadError(
                f"plugin {name!r} (distribution {dist}) failed to load: {reason}; "
                f"fix or uninstall it, or set {DISABLE_ENV}={name}"
            ) from cause
        log.warning("plugin %r (distribution %s) failed to load and is skipped: %s", name, dist, reason)
        self.reports.append(LoadReport(name, dist, version, f"failed: {reason}", **flags))

    def forget(self, name: str) -> None:
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self.provenance.pop(name, None)
        self.reports = [r for r in self.reports if r.name != name]


def _unknown(hooks: list[str]) -> str:
    known = [h for h in dir(LayerBoundarySpecs) if h.startswith(f"{PROJECT}_")]
    parts = []
    for hook in hooks:
        close = difflib.get_close_matches(hook, known, n=1)
        parts.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(parts) + f"; the hooks are {', '.join(known)}"


@functools.lru_cache(maxsize=None)
def _plugins() -> _Plugins:
    state = _Plugins()
    disabled = disabled_plugins()
    strict = _strict()
    core_version = _version_of("layer-boundary")
    for name, module in BUILTIN_PLUGINS:
        state.register(module, name, "layer-boundary", core_version, strict=True, builtin=True)
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        if ep.name in seen:
            continue  # the same distribution visible twice on sys.path
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        if ep.name in disabled:
            state.reports.append(LoadReport(ep.name, dist, version, "disabled"))
            continue
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of an optional plugin
            state.fail(ep.name, dist, version, f"{type(exc).__name__}: {exc}", strict=strict, cause=exc)
            continue
        state.register(module, ep.name, dist, version, strict=strict)
    for name, inline in _INLINE.items():
        if name in disabled:
            state.reports.append(LoadReport(name, inline.distribution, inline.version, "disabled", inline=True))
        elif state.pm.get_plugin(name) is None and name not in seen:
            state.register(inline.plugin, name, inline.distribution, inline.version, strict=strict, inline=True)
    state.pm.check_pending()  # every registered implementation has a spec (offenders were skipped above)
    return state


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's pluggy manager (plugins registered, specs added)."""
    return _plugins().pm


# collecting records -----------------------------------------------------------------------------


def _hook_results(state: _Plugins, hook_name: str) -> Iterator[tuple[str, Optional[str], Optional[str], list]]:
    """(plugin, distribution, version, records) per implementation, each called on its own so
    that every record keeps its provenance."""
    for impl in getattr(state.pm.hook, hook_name).get_hookimpls():
        dist, version = state.provenance.get(impl.plugin_name, (None, None))
        try:
            records = list(impl.function() or ())
        except Exception as exc:
            raise PluginError(
                f"plugin {impl.plugin_name!r} (distribution {dist}) raised in {hook_name}: {type(exc).__name__}: {exc}; "
                f"set {DISABLE_ENV}={impl.plugin_name} to run without it"
            ) from exc
        yield impl.plugin_name, dist, version, records


def _registered(plugin, dist, version, records: Iterable, hook_name: str, record_type, builtin: bool) -> list[Registered]:
    out = []
    for record in records:
        if not isinstance(record, record_type):
            raise PluginError(
                f"plugin {plugin!r} (distribution {dist}) yielded {type(record).__name__} from {hook_name}; "
                f"expected {record_type.__name__}"
            )
        out.append(Registered(record, plugin, dist, version, builtin))
    return out


def _ordered(items: list[Registered], record_type) -> tuple[Registered, ...]:
    by_name: dict[str, Registered] = {}
    for item in items:
        other = by_name.get(item.name)
        if other is not None:
            raise PluginError(
                f"two plugins register the {record_type.__name__} {item.name!r}: "
                f"{other.plugin!r} (distribution {other.distribution}) and {item.plugin!r} "
                f"(distribution {item.distribution}); uninstall one or set {DISABLE_ENV}"
            )
        by_name[item.name] = item
    return tuple(sorted(items, key=selection_key))


def _plugin_order(state: _Plugins, names) -> list[str]:
    builtin = {r.name for r in state.reports if r.builtin}
    return sorted(names, key=lambda n: (n not in builtin, n))


def _lifecycle_call(impl):
    """`call(request)` for a life-cycle hook implementation (which may take no argument: pluggy's
    opt-in arguments)."""
    function = impl.function
    if "request" in impl.argnames:
        return lambda request: function(request=request)
    return lambda request: function()


#: the registry `get_registry()` built last, in a plain list: what `current_registry()` reads
_CURRENT: list = []


def current_registry() -> Registry:
    """`get_registry()` for code that runs inside a model's forward: once the registry is built
    (building a model builds it) this is one read of a plain module list, which a compiler's
    tracer (Dynamo) follows and guards on; it cannot follow the cached call itself."""
    if _CURRENT:
        return _CURRENT[0]
    return get_registry()


@functools.lru_cache(maxsize=None)
def get_registry() -> Registry:
    """The registry of this process (cached; `reset_registry()` forgets it)."""
    registry = _build_registry()
    _CURRENT[:] = [registry]
    return registry


def _build_registry() -> Registry:
    state = _plugins()
    builtin = {r.name for r in state.reports if r.builtin}
    collected: dict[str, list[Registered]] = {key: [] for key in HOOKS}
    for key, (hook, rtype) in HOOKS.items():
        for plugin, dist, version, records in _hook_results(state, hook):
            collected[key].extend(_registered(plugin, dist, version, records, hook, rtype, plugin in builtin))
    lifecycle = {}
    for hook in LIFECYCLE_HOOKS:
        impls = {impl.plugin_name: _lifecycle_call(impl) for impl in getattr(state.pm.hook, hook).get_hookimpls()}
        lifecycle[hook] = tuple((name, impls[name]) for name in _plugin_order(state, impls))
    return Registry(
        **{key: _ordered(items, HOOKS[key][1]) for key, items in collected.items()},
        prepare_hooks=lifecycle["layer_boundary_prepare_model"],
        release_hooks=tuple(reversed(lifecycle["layer_boundary_release_model"])),
        plugins=tuple(sorted(state.reports, key=lambda r: (not r.builtin, r.name))),
    )


#: called with no argument whenever the registry is forgotten (caches derived from it: the
#: add + norm kernels the norms chose)
_ON_RESET: list = []


def on_registry_reset(callback) -> None:
    """Call `callback()` whenever the registry is forgotten (a cache derived from its records)."""
    _ON_RESET.append(callback)


def add_builtin(name: str, module) -> None:
    """Register `module` as the built-in plugin `name` (its hooks are asked after every other
    plugin's); called by the built-in plugin's own module when it is imported."""
    if all(existing != name for existing, _ in BUILTIN_PLUGINS):
        BUILTIN_PLUGINS.append((name, module))


def _forget_registry() -> None:
    get_registry.cache_clear()
    _CURRENT.clear()
    for callback in _ON_RESET:
        callback()


def reset_registry() -> None:
    """Forget the cached manager and registry (tests; after installing a plugin). Inline
    registrations stay."""
    _plugins.cache_clear()
    _forget_registry()


# inline registration -----------------------------------------------------------------------------


def register_inline(plugin, *, name: str, distribution: Optional[str] = None, version: Optional[str] = None) -> None:
    """Register `plugin` (a module or an object with `@hookimpl` methods) as the plugin `name`,
    in this process, without installing a distribution: tests, and source checkouts on a
    machine where the plugin's distribution is not installed. The same checks as for an entry
    point apply (an unknown hook is reported, or an error when strict); an installed plugin of
    the same name wins. It stays registered across `reset_registry()` until
    `unregister_inline(name)`."""
    if name in _INLINE:
        raise PluginError(f"an inline plugin named {name!r} is already registered; unregister_inline({name!r}) first")
    _INLINE[name] = _Inline(plugin, distribution or f"inline:{name}", version)
    if _plugins.cache_info().currsize:  # a manager exists: register into it now
        state = _plugins()
        if name in disabled_plugins():
            state.reports.append(LoadReport(name, _INLINE[name].distribution, version, "disabled", inline=True))
        elif state.pm.get_plugin(name) is None:
            try:
                state.register(plugin, name, _INLINE[name].distribution, version, strict=_strict(), inline=True)
            except PluginError:
                del _INLINE[name]
                raise
    _forget_registry()


def unregister_inline(name: str) -> None:
    """Undo `register_inline(name)` (a no-op when no inline plugin has that name)."""
    inline = _INLINE.pop(name, None)
    if inline is None:
        return
    if _plugins.cache_info().currsize:
        state = _plugins()
        if state.pm.get_plugin(name) is inline.plugin:
            state.forget(name)
        else:
            state.reports = [r for r in state.reports if not (r.name == name and r.inline)]
    _forget_registry()


@contextlib.contextmanager
def inline_plugin(plugin, *, name: str, distribution: Optional[str] = None, version: Optional[str] = None):
    """`register_inline` for the duration of a block."""
    register_inline(plugin, name=name, distribution=distribution, version=version)
    try:
        yield plugin
    finally:
        unregister_inline(name)
