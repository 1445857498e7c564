"""Model-level setup from plugins: workspaces and compiled kernels a fusion needs before the
first forward (and before any CUDA-graph capture), and their release.

A plugin registers an `Adapter` of kind "setup"; its factory receives a `ModelSetup` and does the
phase's work. An engine (or `layer-boundary run`) calls `prepare_model()` on every rank after the
weights are in place, and `release_model()` on every rank before destroying process groups. Both
run the plugins in registry order (release in reverse), identically on every rank.
"""

from __future__ import annotations

import attrs

from .plugin._manager import get_registry

__all__ = ["ModelSetup", "prepare_model", "release_model"]


@attrs.frozen
class ModelSetup:
    model: object
    #: the largest token count a forward will have (sizes workspaces)
    max_tokens: int
    #: "prepare" or "release"
    phase: str


def _run(model, max_tokens: int, phase: str) -> list[str]:
    items = get_registry().adapters_of("setup")
    if phase == "release":
        items = tuple(reversed(items))
    done = []
    for item in items:
        item.record.factory(ModelSetup(model, max_tokens, phase))
        done.append(item.name)
    return done


def prepare_model(model, *, max_tokens: int = 2048) -> list[str]:
    """Let every installed plugin prepare `model` (collective: call on all ranks). Returns the
    names of the setup records that ran."""
    return _run(model, max_tokens, "prepare")


def release_model(model) -> list[str]:
    """Release what `prepare_model` created (collective: call on all ranks)."""
    return _run(model, 0, "release")
