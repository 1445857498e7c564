"""Reading a Hugging Face config field by field: what a model family's `parse` calls so that a
partial or mistyped config is one line naming the family, the field and the type it needs,
instead of a `KeyError` or `ValueError` from deep inside the parser.

    fields = ConfigFields(raw, "qwen3")
    hidden = fields.int("hidden_size", min=1)              # required: a positive integer
    head_dim = fields.int("head_dim", hidden // heads, min=1)   # absent or null: the default
    eps = fields.float("rms_norm_eps", 1e-6, positive=True)

A key that is absent or null takes the default; without a default it is required.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ._families import ConfigError

__all__ = ["ConfigFields", "REQUIRED", "json_type"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: the default of a field the config must give
REQUIRED: Any = _Required()


def json_type(value: Any) -> str:
    """The JSON name of `value`'s type, as a config's author wrote it."""
    if value is None:
        return "null"
    if isinstance(value, builtins.bool):
        return "a boolean"
    if isinstance(value, builtins.int):
        return "an integer"
    if isinstance(value, builtins.float):
        return "a number"
    if isinstance(value, builtins.str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (builtins.list, builtins.tuple)):
        return "a list"
    return type(value).__name__


class ConfigFields:
    """A config (`raw`, a mapping) read for family `family`: each accessor returns the field's
    value with its type checked, or raises `error` (default `ConfigError`) in one line naming
    the family, the field, the type it needs and what the config holds."""

    def __init__(self, raw: Any, family: str, *, error: type = ConfigError, prefix: str = ""):
        if not isinstance(raw, Mapping):
            where = f" {prefix.rstrip('.')}" if prefix else ""
            raise error(f"{family} config{where}: expected a JSON object of fields, got {json_type(raw)}")
        self.raw = raw
        self.family = family
        self.error = error
        self.prefix = prefix

    def sub(self, key: str) -> "ConfigFields":
        """The fields of the object `key` (an empty one when absent or null), named
        `key.field` in errors."""
        return ConfigFields(self.dict(key, {}), self.family, error=self.error, prefix=f"{self.prefix}{key}.")

    # -- plain access -------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        """Whether the config gives `key` (present and not null)."""
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value of `key` (unchecked), `default` when absent or null."""
        value = self.raw.get(key)
        return default if value is None else value

    def fail(self, key: str, need: str) -> ConfigError:
        """The error for field `key` that is not `need` (raise it)."""
        value = self.raw.get(key)
        name = f"{self.prefix}{key}"
        if value is None:
            return self.error(f"{self.family} config: {name} is missing; it needs {need}")
        return self.error(f"{self.family} config: {name} must be {need}, got {value!r} ({json_type(value)})")

    # -- typed fields -------------------------------------------------------------------------

    def int(self, key: str, default: Any = REQUIRED, *, min: Optional[builtins.int] = None) -> Any:
        """An integer field (a boolean is not one), at least `min` when given."""
        need = "an integer" if min is None else ("a positive integer" if min == 1 else f"an integer >= {min}")
        return self._field(key, default, need, lambda v: isinstance(v, builtins.int) and not isinstance(v, builtins.bool)
                           and (min is None or v >= min))

    def float(self, key: str, default: Any = REQUIRED, *, positive: builtins.bool = False) -> Any:
        """A number (an integer too; returned as float), greater than 0 when `positive`."""
        need = "a positive number" if positive else "a number"

        def ok(v):
            return isinstance(v, (builtins.int, builtins.float)) and not isinstance(v, builtins.bool) and (not positive or v > 0)

        return self._field(key, default, need, ok, builtins.float)

    def bool(self, key: str, default: Any = REQUIRED) -> Any:
        """A boolean field (true or false)."""
        return self._field(key, default, "true or false", lambda v: isinstance(v, builtins.bool))

    def str(self, key: str, default: Any = REQUIRED, *, choices: Optional[Iterable[builtins.str]] = None) -> Any:
        """A string field, one of `choices` when given."""
        allowed = None if choices is None else tuple(choices)
        need = "a string" if allowed is None else "one of " + ", ".join(repr(c) for c in allowed)
        return self._field(key, default, need, lambda v: isinstance(v, builtins.str) and (allowed is None or v in allowed))

    def list(self, key: str, default: Any = REQUIRED, *, of: Optional[type] = None) -> Any:
        """A list field (returned as a tuple), each item of type `of` when given."""
        item = {builtins.int: "integers", builtins.str: "strings", builtins.float: "numbers"}.get(of, getattr(of, "__name__", ""))
        need = "a list" if of is None else f"a list of {item}"

        def ok(v):
            if not isinstance(v, (builtins.list, builtins.tuple)):
                return False
            return of is None or all(isinstance(x, of) and not (of is not builtins.bool and isinstance(x, builtins.bool)) for x in v)

        return self._field(key, default, need, ok, builtins.tuple)

    def dict(self, key: str, default: Any = REQUIRED) -> Any:
        """An object field."""
        return self._field(key, default, "an object", lambda v: isinstance(v, Mapping))

    def first(self, keys: Sequence[builtins.str]) -> Optional[builtins.str]:
        """The first of `keys` the config gives (aliases of one field), or None."""
        return next((k for k in keys if self.has(k)), None)

    def _field(self, key: str, default: Any, need: str, ok: Callable[[Any], builtins.bool], convert: Callable = lambda v: v) -> Any:
        """The checked value of `key` (converted), or `default` when absent or null."""
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                raise self.fail(key, need)
            return default
        if not ok(value):
            raise self.fail(key, need)
        return convert(value)
