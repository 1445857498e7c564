"""The one parser of the environment variables the core and its plugins read.

Every switch is read the same way: unset or blank means the default; `1/true/yes/on` and
`0/false/no/off` (any case) mean what they say; anything else is an error naming the variable,
so a typo never silently flips a setting (which would differ between ranks that set it
differently).
"""

from __future__ import annotations

import os

__all__ = ["env_flag", "env_names"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean switch `name`: `default` when unset or blank."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a switch; set it to 1 or 0 (or true/false, yes/no, on/off)")


def env_names(name: str) -> frozenset[str]:
    """The comma-separated names in `name` (blank entries dropped)."""
    return frozenset(part.strip() for part in os.environ.get(name, "").split(",") if part.strip())


