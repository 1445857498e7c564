"""Tensor-parallel reference models written against the public API.

Each model family registers a `ModelFamily`: its embedded tiny config, how to parse a Hugging
Face config, build the model for a `Parallel`, load weights and draw random ones. The runner,
the CLI and the tests only go through this table.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Callable

import attrs

from .config import ConfigError, DecoderConfig, load_hf_config

__all__ = ["MODELS", "ModelFamily", "ConfigError", "DecoderConfig", "build_model", "family", "load_hf_config", "model_config", "register_model"]

#: modules that register model families when first needed (one line per family module)
FAMILY_MODULES = (
    "layer_boundary.models.decoder_families",
    "layer_boundary.models.deepseek_v4_family",
    "layer_boundary.models.nemotron_h_family",
    "layer_boundary.models.longcat",
    "layer_boundary.models.residual_families",
)


@attrs.frozen(kw_only=True)
class ModelFamily:
    name: str
    model_type: str
    #: the embedded tiny Hugging Face config (a dict, with model_type)
    preset: dict
    #: HF config dict -> the model's config (has .hf, .architecture, .num_layers, .vocab_size,
    #: .hidden_size and .check_topology(topology))
    parse: Callable[[dict], Any]
    #: (config, parallel, *, reduction, fusions, dtype, device[, lora]) -> the model
    build: Callable[..., Any]
    #: (model, TensorSource) -> None
    load_weights: Callable[..., None]
    #: (config, dtype, seed) -> a state dict with Hugging Face names
    random_weights: Callable[..., dict]
    description: str = ""
    #: features from plugins the model needs, as (registry kind, name): ("residual_kind", "mhc"),
    #: ("adapter", "branch"); checked before any rank starts, naming the distribution to install
    requires: tuple = ()
    #: per-dtype overrides of the relative logit error allowed against Hugging Face, for a family
    #: whose HF reference itself rounds parts through float32 (and so is not reproducible beyond that)
    tolerances: dict = attrs.field(factory=dict)
    #: the model carries LoRA adapters on its projections (`build(..., lora=LoraSpec)`, `--lora N`)
    lora: bool = False


MODELS: dict[str, ModelFamily] = {}
_loaded = False


def register_model(fam: ModelFamily) -> ModelFamily:
    if fam.name in MODELS and MODELS[fam.name] is not fam:
        raise ValueError(f"model family {fam.name!r} is registered twice")
    MODELS[fam.name] = fam
    return fam


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in FAMILY_MODULES:
            importlib.import_module(module)
        _loaded = True  # only once every family is registered (threaded ranks may race here)


def family(name: str) -> ModelFamily:
    _load()
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    return MODELS[name]


def model_config(name: str, hf_config: dict | None = None):
    """The config of model `name`: its embedded tiny default, or `hf_config`."""
    fam = family(name)
    raw = copy.deepcopy(fam.preset) if hf_config is None else dict(hf_config)
    if raw.get("model_type") != fam.model_type:
        raise ConfigError(f"--model {name} needs a config with model_type {fam.model_type!r}, got {raw.get('model_type')!r}")
    return fam.parse(raw)


def build_model(config, parallel, *, reduction="ar", fusions=None, dtype=None, device=None, lora=None):
    """Build the model of `config` (its family is found by the config's model_type); `lora`, a
    `LoraSpec`, gives its projections those adapters (families with `lora=True` only)."""
    _load()
    fam = next((f for f in MODELS.values() if f.model_type == config.model_type), None)
    if fam is None:
        raise ConfigError(f"no model family for model_type {config.model_type!r}")
    if lora is None:
        return fam.build(config, parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device)
    if not fam.lora:
        supported = ", ".join(sorted(f.name for f in MODELS.values() if f.lora)) or "none"
        raise ConfigError(f"model {fam.name!r} has no LoRA reference layers; LoRA runs with: {supported}")
    return fam.build(config, parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device, lora=lora)


_POINTS = {"residual_kind": "residual kind", "branches": "prepared branches:", "overlaps": "two-batch overlap:"}


def check_requirements(fam: ModelFamily) -> None:
    """Raise `MissingPluginError` naming the distribution when a required feature is absent."""
    from .._errors import missing_feature
    from ..plugin._manager import get_registry

    registry = get_registry()
    for point, name in fam.requires:  # (registry field or "residual_kind", feature name)
        found = registry.residual_kinds_of(name) if point == "residual_kind" else registry.records(point)
        if not found:
            raise missing_feature(f"model {fam.name!r} ({_POINTS.get(point, point)} {name!r})", name)

