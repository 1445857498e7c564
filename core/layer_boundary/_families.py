"""What a model family and the tools that run it (`layer-boundary run`, `plan`, `bench decode`,
an engine's own harness) hand each other: the rows of a step (`StepLayout`, `DecodeLayout`),
where weights come from (`TensorSource`), and the error a family raises for a config, checkpoint
or weight it cannot use (`ConfigError`, reported as one line before any rank starts).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

__all__ = ["ConfigError", "StepLayout", "DecodeLayout", "TensorSource", "StateDictSource"]


class ConfigError(ValueError):
    """A config, checkpoint or weights a model family cannot use; the message names the field,
    file or tensor and the fix."""


class StepLayout:
    """Which rows of a step belong to which request, and how long each request's past is.

    `rids` are the request ids of this rank's rows in row order, `counts` their token counts,
    `past` the tokens each request already has in its cache. `dp_request_counts` (optional)
    lists, for every attention-DP rank, the token counts of its requests in row order: the
    request layout of the DP-gathered rows an FFN sees.
    """

    __slots__ = ("rids", "starts", "counts", "past", "positions", "dp_request_counts")

    def __init__(self, rids, counts, past, device=None, dp_request_counts=None):
        self.rids = list(rids)
        self.counts = list(counts)
        self.past = list(past)
        self.dp_request_counts = None if dp_request_counts is None else tuple(tuple(c) for c in dp_request_counts)
        self.starts = [sum(self.counts[:i]) for i in range(len(self.counts))]
        pos = [torch.arange(p, p + c) for p, c in zip(self.past, self.counts)]
        self.positions = torch.cat(pos).to(device) if pos else torch.zeros(0, dtype=torch.long, device=device)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


class DecodeLayout:
    """A decode step with device tensors only (CUDA-graph capturable): one token per request,
    request `i` in cache slot `slots[i]` at position `positions[i]`; `slots=None`: request `i`
    in slot `i` (the cache is read in place, no gather). A family's static cache may return a
    subclass carrying the step's cache facts."""

    __slots__ = ("slots", "positions")

    def __init__(self, slots: Optional[torch.Tensor], positions: torch.Tensor):
        self.slots = slots
        self.positions = positions

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class TensorSource:
    """Tensors by Hugging Face name: what a family's `load_weights(model, source)` reads, one
    tensor at a time, each rank slicing its own shard."""

    def get(self, name: str) -> Optional[torch.Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def require(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise ConfigError(f"the weights have no tensor {name!r}; is the checkpoint for this model and config?")
        return t


class StateDictSource(TensorSource):
    """A state dict (tensors by name) as a source."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state

    def get(self, name):
        return self.state.get(name)
