"""`layer-boundary plugins [--json]`: installed plugins and their records in selection order."""

from __future__ import annotations

import json

from ..plugin._manager import HOOKS, PluginError, get_registry


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and their records in selection order")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def report() -> dict:
    registry = get_registry()
    return {
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "status": p.status,
                "builtin": p.builtin,
            }
            for p in registry.plugins
        ],
        "records": {
            key: [
                {
                    "name": r.name,
                    "plugin": r.plugin,
                    "distribution": r.distribution,
                    "priority": r.priority,
                    **({"kind": r.record.kind} if hasattr(r.record, "kind") else {}),
                    "description": r.record.description,
                }
                for r in registry.records(key)
            ]
            for key in HOOKS
        },
    }


def run(args) -> int:
    from .main import UsageError

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
        tag = " (built-in)" if p["builtin"] else ""
        print(f"  {p['name']:<{width}}  {p['status']:<10}  {dist}{tag}")
    for key, records in data["records"].items():
        print(f"\n{key.replace('_', ' ')} (selection order):")
        if not records:
            print("  (none)")
        for r in records:
            kind = f" [{r['kind']}]" if "kind" in r else ""
            print(f"  {r['priority']:>6}  {r['name']}{kind}  ({r['plugin']})  {r['description']}")
    return 0
