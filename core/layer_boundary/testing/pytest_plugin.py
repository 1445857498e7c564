"""Opt-in pytest plugin: `pytest_plugins = ["layer_boundary.testing.pytest_plugin"]`.

Fixtures:
- `thread_world(size)`: a fresh threaded world of `size` ranks (a factory);
- `gloo_world(size)`: a gloo world of `size` processes, started once per session and reused;
- `gpu_world(size)`: `size` rank processes on the visible GPUs (NCCL with a GPU each, or sharing
  GPUs over gloo: correctness only), started once per session; skips the test without CUDA;
- `fresh_registry`: forget the cached registry before and after the test;
- `one_thread`: one intra-op torch thread for a module's tests (apply it with
  `pytestmark = pytest.mark.usefixtures("one_thread")`);
- `fresh_dynamo`: one intra-op thread and a reset Dynamo (cache and break counter) around a test,
  for tests that count graphs or breaks;
- `inline_plugin(obj, name=...)`: register hook implementations for the test's duration
  (`layer_boundary.plugin.register_inline`: the checks of an installed plugin apply).

Marks: `gpu` (a test that needs a CUDA GPU; `contract_params` marks its CUDA cases with it),
registered here so a plugin author's suite runs it with `--strict-markers` and without
`PytestUnknownMarkWarning`; `-m "not gpu"` leaves those cases out.

The provider contract suite a plugin's records must pass is `layer_boundary.testing.contract`
(`contract_params(...)` for one pytest case per rule and device).
"""

from __future__ import annotations

import pytest

from .._plugins.manager import register_inline, reset_registry, unregister_inline
from .threaded import ThreadWorld

#: the marks this plugin's users' tests carry (the contract suite's CUDA cases: `gpu`)
MARKS = {"gpu": "needs a CUDA GPU (the contract suite's CUDA cases; they skip without one)"}


def pytest_configure(config):
    for name, description in MARKS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


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


@pytest.fixture(scope="session")
def gpu_world():
    from ..launch import ProcessWorld
    from ..placement import NO_MULTICAST_ENV

    worlds: dict[int, ProcessWorld] = {}

    def get(size: int, timeout: float = 300.0) -> ProcessWorld:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)")
        if size not in worlds:
            worlds[size] = ProcessWorld(size, device="cuda", env=NO_MULTICAST_ENV, timeout=timeout, collective_timeout=timeout)
        return worlds[size].start()

    yield get
    for world in worlds.values():
        world.close()


@pytest.fixture
def fresh_dynamo():
    """A test that counts graphs or breaks starts from an empty Dynamo cache and break counter
    (and one intra-op thread), and leaves none of its graphs behind."""
    import torch

    from ..compiling import reset_graph_breaks

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    reset_graph_breaks()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module, restored after: tiny shapes run fastest on one, and
    several threads per process contend for a loaded machine's cores (test worlds of several
    ranks, helpers sharing it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
