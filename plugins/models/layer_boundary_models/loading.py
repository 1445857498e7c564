"""Weights for a built model: a seeded random state dict, a state dict, or a save_pretrained()
folder, loaded through the model's family (found by its config's model_type in the registry).
A reference model refuses a forward until one of these has run (`building.UNLOADED`)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Union

import torch

from layer_boundary.plugin import ConfigError, StateDictSource, TensorSource, get_registry, mark_loaded

__all__ = ["FolderSource", "family_record", "random_weights", "load_weights", "read_config"]


def family_record(model_type: str):
    """The registered `ModelFamily` of `model_type` (the first in selection order)."""
    for registered in get_registry().model_families:
        if registered.record.model_type == model_type:
            return registered.record
    raise ConfigError(f"no model family for model_type {model_type!r} is registered; pip install the package that provides it")


class FolderSource(TensorSource):
    """The `*.safetensors` files of a save_pretrained() folder (one file or shards), each
    tensor read when asked for."""

    def __init__(self, folder: Union[str, Path]):
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{self.folder}: no *.safetensors files; save the model with save_pretrained()")
        self._where = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self._where.update({name: handle for name in handle.keys()})

    def get(self, name):
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)


def read_config(folder: Union[str, Path]) -> dict:
    """The config.json of a save_pretrained() folder, as a dict."""
    import json

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json; pass the folder save_pretrained() wrote")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds no config object")
    return raw


def random_weights(config, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """A seeded random state dict (Hugging Face names) for `config`, from its family."""
    return family_record(config.model_type).random_weights(config, dtype, seed)


def load_weights(model, weights: Union[Mapping[str, torch.Tensor], TensorSource, str, Path]) -> None:
    """Fill `model` (this rank's shard) from a state dict, a `TensorSource` or a save_pretrained()
    folder, through its family's `load_weights`; afterwards its forward runs."""
    if isinstance(weights, (str, Path)):
        source = FolderSource(weights)
    elif isinstance(weights, TensorSource):
        source = weights
    elif isinstance(weights, Mapping):
        source = StateDictSource(weights)
    else:
        raise TypeError(f"weights: expected a state dict, a TensorSource or a folder, got {type(weights).__name__}")
    family_record(model.config.model_type).load_weights(model, source)
    mark_loaded(model)
