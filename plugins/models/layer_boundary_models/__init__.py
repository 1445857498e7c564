"""layer-boundary-models: tensor-parallel reference model families written against the public
API, the way an engine's model author writes them (each layer declares its stages once and
keeps its compute), with their Hugging Face references and checkpoint loading.

The families reach `layer-boundary run`, `plan` and `bench decode` through the plugin hook
`layer_boundary_model_families` (`plugin.FAMILIES`), like a third party's. The functions here
build them directly, for tests and for code that holds a model's config already:

    config = model_config("qwen3")                       # the embedded tiny config
    model = build_model(config, Parallel.single())       # parameters uninitialised: a forward refuses
    load_weights(model, random_weights(config))          # or a state dict, or a save_pretrained() folder
    model = from_pretrained(folder, Parallel.single())   # config, build and weights from one folder

A model built on the meta device (`device="meta"`) has no storage and is for plans only.
This package imports nothing at import time: the model code loads when a family is used.
"""

from __future__ import annotations

__all__ = ["family", "families", "model_config", "build_model", "random_weights", "load_weights", "from_pretrained"]


def families() -> dict:
    """The `ModelFamily` records of this distribution, by `--model` name."""
    from .plugin import FAMILIES

    return {f.model: f for f in FAMILIES}


def family(name: str):
    """The `ModelFamily` record of `name`."""
    from .config import ConfigError

    found = families().get(name)
    if found is None:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(sorted(families()))}")
    return found


def model_config(name: str, hf_config: dict | None = None):
    """The config of family `name`: its embedded tiny default, or `hf_config`."""
    from .config import ConfigError

    fam = family(name)
    raw = fam.preset() if hf_config is None else dict(hf_config)
    if raw.get("model_type") != fam.model_type:
        raise ConfigError(f"--model {name} needs a config with model_type {fam.model_type!r}, got {raw.get('model_type')!r}")
    return fam.parse(raw)


def build_model(config, parallel, *, reduction="ar", fusions=None, dtype=None, device=None, lora=None, options=None):
    """This rank's model of `config` (its family found by the config's model_type) through the
    family's registered factory; `lora` (a `LoraSpec` or an adapter count) gives its projections
    those adapters, `options` any other run option the family supports. Its parameters are
    uninitialised: it refuses a forward until `load_weights` fills it."""
    from layer_boundary.plugin import BuildRequest, get_registry, select

    from .config import ConfigError

    records = tuple(r for r in get_registry().model_families if r.record.model_type == config.model_type)
    if not records:
        raise ConfigError(f"no model family for model_type {config.model_type!r} is registered")
    options = dict(options or {})
    if lora is not None:
        if "lora" not in records[0].record.options:
            supported = ", ".join(sorted(f.model for f in families().values() if "lora" in f.options)) or "none"
            raise ConfigError(f"model {config.model_type!r} has no LoRA reference layers; LoRA runs with: {supported}")
        options["lora"] = lora
    request = BuildRequest(config=config, parallel=parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device, options=options)
    # a model's own construction error (a config it cannot split) is the caller's: let it through
    chosen = select("model_families", (request,), records=records, subject=f"building a {config.model_type} model", error_type=None)
    if chosen.chosen is None:
        raise ConfigError(f"no {config.model_type} family builds this model: " + "; ".join(f"{a.candidate}: {a.reason}" for a in chosen.declined))
    return chosen.value


def random_weights(config, dtype=None, seed: int = 0) -> dict:
    """A seeded random state dict (Hugging Face names) for `config`, drawn by its family
    (float32 unless `dtype`)."""
    import torch

    from .loading import random_weights as draw

    return draw(config, dtype or torch.float32, seed)


def load_weights(model, weights) -> None:
    """Fill `model` from a state dict (e.g. `random_weights(config)`), a `TensorSource`, or a
    save_pretrained() folder; each rank keeps its shard. Until this runs the model refuses a
    forward (`layer_boundary.plugin.UnloadedWeightsError`)."""
    from .loading import load_weights as load

    load(model, weights)


def from_pretrained(folder, parallel, *, reduction="ar", fusions=None, dtype=None, device=None, options=None):
    """This rank's model of the save_pretrained() folder `folder` (its config.json and
    *.safetensors), built and loaded."""
    from .loading import read_config

    raw = read_config(folder)
    found = [f.model for f in families().values() if f.model_type == raw.get("model_type")]
    if not found:
        from .config import ConfigError

        raise ConfigError(f"{folder}: model_type {raw.get('model_type')!r} is not a reference family's; choose one of {', '.join(sorted(families()))}")
    config = model_config(found[0], raw)
    model = build_model(config, parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device, options=options)
    load_weights(model, folder)
    return model
