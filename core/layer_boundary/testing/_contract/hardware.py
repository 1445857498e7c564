"""Without hardware: what a plugin's import and its factory do where there is no accelerator,
checked in a fresh interpreter with CUDA hidden (one forked child per plugin, so one plugin's
imports never hide another's)."""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
from importlib import metadata
from typing import Callable, Iterable, Optional, Sequence

import attrs
import torch

from ..._parallel import Topology
from ..._plugins.manager import BUILTIN_PLUGINS, DISABLE_ENV, ENTRY_POINT_GROUP, reset_registry
from ..._plugins.records import FusionProvider, Registered
from ..._plugins.selection import call_record
from .records import kind_of
from .report import ContractReport, ContractSettings
from .stages import stage_descriptions


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _foreign(new_modules: Iterable[str], baseline_tops: set, own: set) -> list[str]:
    allowed = baseline_tops | own | set(sys.stdlib_module_names) | {"torch", "layer_boundary"}
    return sorted({_top(m) for m in new_modules if _top(m) not in allowed and not _top(m).startswith("_")})


def _hardware_free_report(record, registered, descriptions, baseline_tops: set, plugin_imports: list, options,
                          allow: set) -> ContractReport:
    """What `record`'s factory does when no accelerator is present (CUDA hidden or absent)."""
    report = ContractReport(record.name, kind_of(record))
    # the plugin's own package: where its factory lives (a `lazy` factory names it)
    home = getattr(record.factory, "target", None) or getattr(record.factory, "__module__", "") or ""
    own = {_top(home)} | allow
    if registered is not None and plugin_imports:
        report.add("without_hardware", f"importing plugin {registered.plugin!r} imported {', '.join(plugin_imports)}; "
                                       "keep heavy imports inside factories, after the applicability checks")
    provider = isinstance(record, FusionProvider)
    for item in descriptions if provider else [dict(o) for o in options or ({},)]:
        before = set(sys.modules)
        try:
            result = call_record(record, item) if provider else call_record(record, **item)
        except Exception as exc:  # noqa: BLE001
            where = f"the {item.label} stage (norm {item.norm_kind}, tp={item.topology.tp})" if provider else f"options {item}"
            report.add("without_hardware", f"factory raised without CUDA on {where}: {type(exc).__name__}: {exc}; "
                                           "return None when the hardware is missing")
            continue
        heavy = _foreign(set(sys.modules) - before, baseline_tops, own)
        declined = result is None
        report.stats["factory_calls_without_hardware"] += 1
        report.stats["declined_without_hardware" if declined else "accepted_without_hardware"] += 1
        if heavy and (declined or not provider):
            report.add("without_hardware", f"factory imported {', '.join(heavy)} without CUDA"
                                           + (" and then declined" if declined else "")
                                           + "; decide from the description first, import after")
    return report


def without_hardware(names: Sequence[str], settings: ContractSettings, options: Optional[dict] = None) -> dict:
    """Run inside a fresh interpreter with CUDA hidden: per record name, a report of what its
    plugin's import and its factory do without an accelerator. Each plugin is checked in a
    forked child of this interpreter, so one plugin's imports never hide another's. `options`
    maps residual-kind names to option lists."""
    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join(ep.name for ep in entry_points)  # describe stages with the core alone
    reset_registry()
    try:
        descriptions = stage_descriptions(settings)
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous
        reset_registry()
    baseline_tops = {_top(m) for m in sys.modules}
    disabled = {n.strip() for n in (previous or "").split(",")}
    sources = [(name, functools.partial(lambda m: m, module)) for name, module in BUILTIN_PLUGINS]
    sources += [(ep.name, ep.load) for ep in entry_points if ep.name not in disabled]
    wanted = set(names)
    out: dict = {}
    for plugin, load in sources:
        check = functools.partial(_plugin_without_hardware, plugin, load, wanted, descriptions, baseline_tops, options or {},
                                  set(settings.allow_imports))
        out.update(_in_child(check, settings.timeout * 10))
    for name in wanted - set(out):
        report = ContractReport(name, "record")
        report.add("without_hardware", f"no plugin loaded in a fresh interpreter registers {name!r} (disabled, or failed to load?)")
        out[name] = report.to_json()
    return out


def _plugin_without_hardware(plugin, load, wanted, descriptions, baseline_tops, options, allow) -> dict:
    before = set(sys.modules)
    try:
        module = load()
    except Exception:  # noqa: BLE001 - the registry reports load failures itself
        return {}
    imports = _foreign(set(sys.modules) - before, baseline_tops, {_top(getattr(module, "__name__", ""))} | allow)
    out = {}
    for hook in ("layer_boundary_fusion_providers", "layer_boundary_residual_kinds"):
        for record in getattr(module, hook, lambda: ())() or ():
            if record.name in wanted:
                registered = Registered(record, plugin, None, None)
                report = _hardware_free_report(record, registered, descriptions, baseline_tops, imports, options.get(record.name), allow)
                out[record.name] = report.to_json()
    return out


def _in_child(fn: Callable[[], dict], timeout: float) -> dict:
    """`fn()` in a forked child (its imports stay there); in this process where fork is missing."""
    if not hasattr(os, "fork"):
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
        os.close(read_end)
        try:
            payload = json.dumps(fn()).encode()
        except BaseException as exc:  # noqa: BLE001
            payload = json.dumps({"__error__": f"{type(exc).__name__}: {exc}"}).encode()
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], timeout)
            if not ready:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise RuntimeError(f"a plugin's without-hardware check did not finish within {timeout:.0f}s")
            chunk = pipe.read1(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    data = json.loads(b"".join(chunks) or b"{}")
    if "__error__" in data:
        raise RuntimeError(f"the without-hardware check failed: {data['__error__']}")
    return data


def without_hardware_here(record, registered, settings: ContractSettings, options) -> ContractReport:
    """The in-process fallback for a record no entry point registers: sound only without CUDA,
    and blind to imports that earlier code of this process already made."""
    if torch.cuda.is_available():
        report = ContractReport(record.name, kind_of(record))
        report.add("without_hardware", "a fresh interpreter with CUDA hidden cannot load a record that no entry point "
                                       "registers; install the plugin (pip install -e) to run this check here")
        return report
    descriptions = stage_descriptions(settings) if isinstance(record, FusionProvider) else ()
    baseline = {_top(m) for m in sys.modules}
    return _hardware_free_report(record, registered, descriptions, baseline, [], options, set(settings.allow_imports))


def without_hardware_subprocess(names: Sequence[str], settings: ContractSettings, options: Optional[dict]) -> dict:
    import pickle

    # pickled, not JSON: a residual kind's options may hold tensors (hyper-connection mappings)
    payload = pickle.dumps({"names": list(names), "settings": settings_to_json(settings), "options": options or {}})
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-m", "layer_boundary.testing.contract", "--without-hardware"], input=payload,
                          capture_output=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the without-hardware check failed to run:\n{proc.stderr.decode(errors='replace')}")
    return json.loads(proc.stdout)


def settings_to_json(settings: ContractSettings) -> dict:
    data = attrs.asdict(settings, recurse=False)
    for key in ("topologies", "described_topologies"):
        data[key] = [attrs.asdict(t) for t in data[key]]
    return data


def settings_from_json(data: dict) -> ContractSettings:
    data = dict(data)
    for key in ("topologies", "described_topologies"):
        data[key] = tuple(Topology(**t) for t in data[key])
    data["tolerances"] = tuple(tuple(t) for t in data["tolerances"])
    return ContractSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
