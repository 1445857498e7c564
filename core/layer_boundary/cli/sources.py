"""Where a run's weights come from: a state dict, or a checkpoint folder read lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .._families import ConfigError, StateDictSource, TensorSource

__all__ = ["CheckpointSource", "open_source"]


class CheckpointSource(TensorSource):
    """The `*.safetensors` files of a folder, opened lazily; a sharded checkpoint through its
    `model.safetensors.index.json` (only the shards it names). `checkpoint.check_checkpoint`
    validates a folder against its model before any rank loads it."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        from .checkpoint import checkpoint_files

        self.folder = Path(folder)
        files, _, problems = checkpoint_files(self.folder)
        if problems:
            raise ConfigError(problems[0])
        self._handles = []
        for f in files:
            try:
                self._handles.append((f.name, safe_open(str(f), framework="pt")))
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
                raise ConfigError(f"{f.name}: cannot be opened as safetensors ({type(exc).__name__}: {exc}); re-copy or re-save it") from None
        self._where = {k: (file, h) for file, h in self._handles for k in h.keys()}

    def get(self, name):
        found = self._where.get(name)
        if found is None:
            return None
        file, handle = found
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{file}: tensor {name} cannot be read ({type(exc).__name__}: {exc})") from None


def open_source(state=None, checkpoint: Optional[str] = None) -> TensorSource:
    """A checkpoint folder's tensors when `checkpoint` is given, else the state dict's."""
    if checkpoint is not None:
        return CheckpointSource(checkpoint)
    return StateDictSource(state)
