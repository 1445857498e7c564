"""Model families as the command line sees them: `ModelFamily` records found by `--model` name
in the registry, so a third party's family package gets `run`, `plan` and `bench decode` like
the reference families (layer-boundary-models) do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .._config_fields import json_type
from .._errors import MissingPluginError, missing_feature
from .._families import ConfigError
from .._plugins.manager import get_registry
from .._plugins.requests import BuildRequest
from .._plugins.selection import select
from .usage import UsageError

__all__ = ["find_family", "load_hf_config", "family_config", "check_requirements", "check_options", "build"]

#: where the reference families come from
MODELS_DISTRIBUTION = "layer-boundary-models"


def find_family(name: str):
    """The registered `ModelFamily` of `--model name` (a `Registered`); one line naming what to
    install when none is."""
    registry = get_registry()
    found = registry.families_of(name)
    if not found:
        installed = sorted({r.record.model for r in registry.model_families})
        if not installed:
            raise UsageError(
                f"--model {name}: no model family is installed; pip install {MODELS_DISTRIBUTION} "
                "(the reference families), or a package that registers yours (layer_boundary_model_families)"
            )
        hint = f"; pip install {MODELS_DISTRIBUTION} for the reference families" if registry.plugin("models") is None else ""
        raise UsageError(f"unknown model {name!r}; installed: {', '.join(installed)}{hint}")
    if len(found) > 1:
        names = ", ".join(f"{r.name} ({r.plugin})" for r in found)
        raise UsageError(f"--model {name}: two plugins register this model family ({names}); uninstall one or disable it")
    return found[0]


def load_hf_config(source: str, flag: str = "--hf-config") -> dict:
    """A config from inline JSON, a config.json path, or a checkpoint folder; every way it can
    be wrong is one `ConfigError` naming `flag` and what was found."""
    text = source.strip()
    if text[:1] in ("{", "["):
        return _inline_config(text, flag)
    path = Path(source)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:  # not a name the file system takes (too long, ...): read it as JSON
        is_dir = is_file = False
    if is_dir:
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{flag} {source}: the folder has no config.json; save the model with save_pretrained() or pass a config.json")
    elif not is_file:
        try:
            return _inline_config(text, flag)
        except ConfigError:
            if text[:1].isalpha() or text[:1] in "./~":
                raise ConfigError(f"{flag} {source}: no such file or folder; pass inline JSON, a config.json file or a checkpoint folder") from None
            raise
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag}: {path} is not valid JSON ({exc}); pass the config.json save_pretrained() writes") from None
    except OSError as exc:
        raise ConfigError(f"{flag}: {path} cannot be read ({exc.strerror or exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: {path} holds {json_type(raw)}, not a config object")
    return raw


def _inline_config(text: str, flag: str) -> dict:
    """A config given inline as a JSON object."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} is valid JSON but {json_type(raw)}, not a config; pass a JSON object of fields ({{...}})")
    return raw


def family_config(item, raw: Optional[dict] = None):
    """The family's parsed config of `raw` (its embedded tiny config when None). A family whose
    parser fails on the config with a Python error (a missing or mistyped field it does not
    check) is reported in one line naming the family and that error."""
    fam = item.record
    raw = fam.preset() if raw is None else dict(raw)
    if raw.get("model_type") != fam.model_type:
        raise ConfigError(f"--model {fam.model} needs a config with model_type {fam.model_type!r}, got {raw.get('model_type')!r}")
    try:
        return fam.parse(raw)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        detail = f"field {exc.args[0]!r} is missing" if isinstance(exc, KeyError) and exc.args else f"{type(exc).__name__}: {exc}"
        raise ConfigError(f"--model {fam.model}: the family {item.name!r} cannot read this config ({detail}); check that field's value") from None


def check_requirements(item) -> None:
    """Raise `UsageError` naming the distribution when a plugin feature the family needs is absent."""
    registry = get_registry()
    for point, name in item.record.requires:
        found = registry.residual_kinds_of(name) if point == "residual_kinds" else registry.records(point)
        if not found:
            raise UsageError(str(missing_feature(f"model {item.record.model!r} ({point.replace('_', ' ')}: {name!r})", name)))


def check_options(item, options: dict) -> None:
    """Refuse a run option the family does not declare (`ModelFamily.options`)."""
    for option in sorted(k for k, v in options.items() if v and k in ("lora", "fp8", "tbo")):
        if option not in item.record.options:
            supported = ", ".join(sorted(item.record.options)) or "none"
            others = sorted({r.record.model for r in get_registry().model_families if option in r.record.options})
            raise UsageError(f"--{option}: model {item.record.model!r} does not support it (its options: {supported}); "
                             f"--{option} runs with: {', '.join(others) or 'no installed model'}")


def build(item, config, parallel, *, reduction: Any = "ar", fusions=None, dtype=None, device=None, options=None):
    """This rank's model of family `item` through its factory (the selection rule: a factory
    that declines is one line saying why)."""
    request = BuildRequest(config=config, parallel=parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device,
                           options=dict(options or {}))
    chosen = select("model_families", (request,), records=(item,), subject=f"building a {item.record.model} model", error_type=None)
    if chosen.chosen is None:
        raise ConfigError(f"model family {item.name!r} does not build this model: {chosen.declined[0].reason}")
    return chosen.value


#: the errors a family raises for input it cannot use, reported as one line
INPUT_ERRORS = (ConfigError, MissingPluginError, ValueError, NotImplementedError)
