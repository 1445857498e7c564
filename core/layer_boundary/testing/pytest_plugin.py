"""Opt-in pytest plugin: `pytest_plugins = ["layer_boundary.testing.pytest_plugin"]`.

Fixtures:
- `thread_world(size)`: a fresh threaded world of `size` ranks (a factory);
- `gloo_world(size)`: a gloo world of `size` processes, started once per session and reused;
- `fresh_registry`: forget the cached registry before and after the test;
- `inline_plugin(obj, name=...)`: register hook implementations for the test's duration
  (`layer_boundary.plugin.register_inline`: the checks of an installed plugin apply).

The provider contract suite a plugin's records must pass is `layer_boundary.testing.contract`
(`contract_params(...)` for one pytest case per rule and device).
"""

from __future__ import annotations

import pytest

from ..plugin._manager import register_inline, reset_registry, unregister_inline
from .threaded import ThreadWorld


@pytest.fixture
def thread_world():
    return lambda size, timeout=30.0: ThreadWorld(size, timeout=timeout)


@pytest.fixture(scope="session")
def gloo_world():
    from .gloo import GlooWorld

    worlds: dict[int, GlooWorld] = {}

    def get(size: int) -> GlooWorld:
        if size not in worlds:
            worlds[size] = GlooWorld(size)
        return worlds[size].start()

    yield get
    for world in worlds.values():
        world.close()


@pytest.fixture
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def inline_plugin():
    names: list[str] = []

    def register(obj, name: str = "inline"):
        register_inline(obj, name=name, distribution=f"test:{name}")
        names.append(name)
        return obj

    yield register
    for name in reversed(names):
        unregister_inline(name)
