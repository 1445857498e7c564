"""`layer-boundary plugins [--json]`: installed plugins, the hooks each implements, and the
records of every extension point in selection order."""

from __future__ import annotations

import json

from .._plugins.manager import HOOKS, PluginError, get_plugin_manager, get_registry

PREFIX = "layer_boundary_"


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and their records in selection order")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def _hooks(pm, name: str) -> list[str]:
    plugin = pm.get_plugin(name)
    callers = pm.get_hookcallers(plugin) if plugin is not None else None
    return sorted(c.name.removeprefix(PREFIX) for c in callers or ())


def _record(r) -> dict:
    return {
        "name": r.name,
        "plugin": r.plugin,
        "distribution": r.distribution,
        "priority": r.priority,
        **({"kind": r.record.kind} if hasattr(r.record, "kind") else {}),
        "description": r.record.description,
    }


def report() -> dict:
    registry = get_registry()
    pm = get_plugin_manager()
    records = {key: [_record(r) for r in registry.records(key)] for key in HOOKS}
    return {
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "status": p.status,
                "builtin": p.builtin,
                "inline": p.inline,
                "hooks": _hooks(pm, p.name),
            }
            for p in registry.plugins
        ],
        "records": records,
    }


def run(args) -> int:
    from .usage import UsageError

    try:
        data = report()
    except PluginError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("plugins:")
    width = max(len(p["name"]) for p in data["plugins"])
    for p in data["plugins"]:
        dist = f"{p['distribution']} {p['version'] or ''}".strip()
        tag = " (built-in)" if p["builtin"] else " (inline)" if p["inline"] else ""
        hooks = f"  [{', '.join(p['hooks'])}]" if p["hooks"] else ""
        print(f"  {p['name']:<{width}}  {p['status']:<10}  {dist}{tag}{hooks}")
    for key, items in data["records"].items():
        print(f"\n{key.replace('_', ' ')} (selection order):")
        if not items:
            print("  (none)")
        for r in items:
            kind = f" [{r['kind']}]" if "kind" in r else ""
            print(f"  {r['priority']:>6}  {r['name']}{kind}  ({r['plugin']})  {r['description']}")
    return 0
