"""Test worlds and helpers for model authors and plugin authors.

Opt in from a conftest: `pytest_plugins = ["layer_boundary.testing.pytest_plugin"]`. Ranks run
as threads (`ThreadWorld`, `run_threaded`) or as processes (`ProcessWorld`: gloo on CPU, NCCL
or a shared GPU on CUDA); `SharedSetting` / `shared_env` switch a process-wide setting for the
ranks of a threaded world. Plugin authors check their records with the provider contract suite,
`layer_boundary.testing.contract`. These modules, like `layer_boundary` and
`layer_boundary.plugin`, are what plugins may import.
"""

import os

from ..launch import ProcessWorld
from .shared import SharedSetting, shared_env
from .threaded import CollectiveAborted, ThreadWorld, run_threaded

__all__ = [
    "ThreadWorld",
    "run_threaded",
    "CollectiveAborted",
    "ProcessWorld",
    "SharedSetting",
    "shared_env",
    "expected_plugins",
    "ALL_PLUGINS",
    "assert_plugin_registers",
    "requires_plugins",
    "logits_rel_error",
]

ALL_PLUGINS = ("flashinfer", "cutedsl", "mhc", "cp", "tbo", "lora", "models")


def expected_plugins() -> tuple[str, ...]:
    """The plugins this test environment installs: LAYER_BOUNDARY_EXPECT_PLUGINS (comma list,
    empty for the core alone), or every plugin when unset (the full development environment)."""
    raw = os.environ.get("LAYER_BOUNDARY_EXPECT_PLUGINS")
    if raw is None:
        return ALL_PLUGINS
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def assert_plugin_registers(name: str) -> list[str]:
    """The plugin `name` loads through its entry point (distribution layer-boundary-<name>) and
    registers at least one record, every one prefixed `<name>.`; returns the record names."""
    from .._plugins.manager import get_registry, reset_registry
    from .._plugins.manager import HOOKS

    reset_registry()
    registry = get_registry()
    report = registry.plugin(name)
    assert report is not None and report.ok, report
    assert report.distribution == f"layer-boundary-{name}"
    names = [r.name for hook in HOOKS for r in registry.records(hook) if r.plugin == name]
    assert names and all(n.startswith(f"{name}.") for n in names), names
    return names


def requires_plugins(*names: str):
    """A pytest mark: skip (with a reason) where this environment does not install `names`.

    Only the install matrix's environments say so (LAYER_BOUNDARY_EXPECT_PLUGINS); in the full
    development environment every plugin is expected, and a missing one is a failure."""
    import pytest

    missing = [n for n in names if n not in expected_plugins()]
    return pytest.mark.skipif(bool(missing), reason=f"needs layer-boundary-{', layer-boundary-'.join(missing)} (not installed in this environment)")


def logits_rel_error(results, ref) -> float:
    """Max |ours - reference| / max |reference| over every request and step.

    `results` are `run_rank` answers (each with a `logits` dict request -> per-step tensors),
    `ref` per request a list of per-step reference logits. Every request must be reported once,
    with the reference's steps and shapes; a non-finite value anywhere fails the comparison."""
    import torch

    got = {}
    for res in results:
        got.update(res["logits"])
    assert sorted(got) == list(range(len(ref))), sorted(got)
    worst, scale = 0.0, 0.0
    for r, steps in enumerate(ref):
        assert len(got[r]) == len(steps)
        for ours, theirs in zip(got[r], steps):
            assert ours.shape == theirs.shape
            ours, theirs = ours.double(), theirs.double()
            assert bool(torch.isfinite(ours).all()) and bool(torch.isfinite(theirs).all()), f"request {r}: non-finite logits"
            worst = max(worst, (ours - theirs).abs().max().item())
            scale = max(scale, theirs.abs().max().item())
    return worst / scale
