"""The model life cycle of plugins: workspaces and compiled kernels a fusion needs before the
first forward (and before any CUDA-graph capture), and their release.

An engine (or `layer-boundary run`) calls `prepare_model()` on every rank after the weights are
in place, and `release_model()` on every rank before destroying process groups. They call the
hooks `layer_boundary_prepare_model` / `layer_boundary_release_model` of every plugin, in
plugin-name order (release in reverse), identically on every rank.
"""

from __future__ import annotations

from ._plugins.manager import get_registry
from ._plugins.requests import PrepareRequest, ReleaseRequest

__all__ = ["prepare_model", "release_model"]


def prepare_model(model, *, max_tokens: int = 2048, settings=None) -> list[str]:
    """Let every installed plugin prepare `model` for forwards of up to `max_tokens` tokens
    (collective: call on all ranks). `settings` maps a plugin's name to the engine's settings
    for it (for example `{"flashinfer": FlashInferSettings(...)}`), the same on every rank.
    Returns the names of the plugins that ran, in order. Every RMSNorm of the model chooses
    (compiles, loads) its add + norm kernel first, for its weight's device and dtype, so no
    choice runs inside a capture; a model family's own kernels (the reference models' rope,
    decode attention and gated activation) are chosen by its plugin's hook."""
    from ._residual.add_norm import prepare_norms

    prepare_norms(model)
    request = PrepareRequest(model, max_tokens, settings)
    done = []
    for name, hook in get_registry().prepare_hooks:
        hook(request)
        done.append(name)
    return done


def release_model(model) -> list[str]:
    """Release what `prepare_model` created (collective: call on all ranks)."""
    request = ReleaseRequest(model)
    done = []
    for name, hook in get_registry().release_hooks:
        hook(request)
        done.append(name)
    return done
