"""A fused multi-rank candidate under `torch.compile(fullgraph=True)`, shown with stub providers
registered inline (no plugin installed).

- A candidate whose launch the tracer cannot follow (it reads `data_ptr()`, as a kernel's
  alignment test does) does not decline and no other candidate runs in its place: tracing
  raises inside it (the boundary wraps that in a `FusionError` naming the candidate). Under
  `fullgraph=True` the call fails with `torch._dynamo.exc.Unsupported`; without it, Dynamo runs
  every frame that exception passed through eagerly (the candidate included, so the values
  still equal eager) and the forward falls apart into many graphs.
- A candidate that calls its kernel as a `torch.library` custom op (finding its launcher by a
  graph key at run time, as the flashinfer and cutedsl plugins do) is one graph node per fused
  boundary, with no break, and equals eager bit for bit.
"""

import pytest
import torch

from layer_boundary import FusedMlpInput, Forward, Parallel, Topology, UnreducedOutput
from layer_boundary.compiling import CountingBackend, graph_breaks, reset_graph_breaks, user_error
from layer_boundary.plugin import FusionProvider, Priority, graph_key, graph_object, hookimpl, register_graph_object

from test_compile_core import MirrorCollectives, TP2Stack


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _add_norm(total, residual, norm):
    summed = total + residual
    return norm(summed), summed


class Launcher:
    """What a plugin binds at prepare: the group's sum + add + norm "kernel" (eager code)."""

    def __init__(self, norm):
        self.norm = norm
        self.launches = 0
        register_graph_object(self, "stub.launcher")

    def __call__(self, partial, group, residual):
        self.launches += 1
        return _add_norm(group.all_reduce(partial.clone()), residual, self.norm)


@torch.library.custom_op("lb_fused_test::all_reduce_add_rmsnorm", mutates_args=())
def stub_fused_op(partial: torch.Tensor, residual: torch.Tensor, launcher: str, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    return graph_object(launcher)(partial, graph_object(group), residual)


@stub_fused_op.register_fake
def _(partial, residual, launcher, group):
    return torch.empty_like(residual), torch.empty_like(residual)


class OpaqueCandidate:
    """Launches as a kernel wrapper does eagerly: an alignment test on the address first."""

    def __init__(self, launcher):
        self.launcher = launcher

    def __call__(self, owed, residual, fwd=None):
        if type(owed) is not UnreducedOutput:
            return None
        if owed.partial.data_ptr() % 16:  # a kernel's 16-byte vectors; the tracer has no address
            return None
        return self.launcher(owed.partial, owed.group, residual)


class OpCandidate(OpaqueCandidate):
    """The same launch, as one custom op inside a compiled region (eager calls stay direct)."""

    def __call__(self, owed, residual, fwd=None):
        if type(owed) is not UnreducedOutput:
            return None
        if torch.compiler.is_compiling():
            return stub_fused_op(owed.partial, residual, graph_key(self.launcher), graph_key(owed.group))
        return self.launcher(owed.partial, owed.group, residual)


class StubProvider:
    def __init__(self, candidate_type):
        self.candidate_type = candidate_type
        self.launchers = []

    def attention_input(self, plan):
        launcher = Launcher(plan.norm)
        self.launchers.append(launcher)
        return (FusedMlpInput(run=self.candidate_type(launcher), name="stub.all_reduce_add_rmsnorm", preserves_residual=True),)

    ffn_input = attention_input


class StubPlugin:
    def __init__(self, candidate_type):
        self.providers = []
        self.candidate_type = candidate_type

    @hookimpl
    def layer_boundary_fusion_providers(self):
        def build(description):
            provider = StubProvider(self.candidate_type)
            self.providers.append(provider)
            return provider

        yield FusionProvider(name="stub.all_reduce_add_rmsnorm", factory=build, priority=Priority.VENDOR)

    def launches(self):
        return sum(launcher.launches for p in self.providers for launcher in p.launchers)


def _stack(plugin, inline_plugin):
    inline_plugin(plugin, name="stub")
    parallel = Parallel.create(Topology(tp=2), 0, MirrorCollectives)
    torch.manual_seed(0)
    return parallel, TP2Stack(parallel).eval()


@torch.inference_mode()
def test_an_opaque_fused_candidate_stops_a_fullgraph_trace_naming_itself(fresh_registry, inline_plugin):
    plugin = StubPlugin(OpaqueCandidate)
    parallel, stack = _stack(plugin, inline_plugin)
    x = torch.randn(4, 32)
    eager = stack(x, Forward(parallel, 4))
    assert plugin.launches() == 3  # the candidate is chosen eagerly at every owed input
    with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
        torch.compile(stack, backend=CountingBackend("eager"), fullgraph=True)(x, Forward(parallel, 4))
    cause = user_error(caught.value)
    assert cause is not None and "stub.all_reduce_add_rmsnorm" in str(caught.value), str(caught.value)[:2000]
    # without fullgraph: Dynamo gives up on every frame the exception passes through and runs
    # those eagerly (the candidate too), so the forward falls apart into many small graphs; its
    # graph-break counter does not see this (frames skipped are counted as "unimplemented")
    torch._dynamo.reset()
    reset_graph_breaks()
    before = plugin.launches()
    backend = CountingBackend("eager")
    out = torch.compile(stack, backend=backend)(x, Forward(parallel, 4))
    assert torch.equal(out, eager) and plugin.launches() == before + 3
    assert backend.graphs > 1, backend.graphs
    from torch._dynamo.utils import counters

    assert any("stub.all_reduce_add_rmsnorm" in reason for reason in counters["unimplemented"])


@torch.inference_mode()
def test_a_fused_candidate_that_calls_a_custom_op_is_one_graph_node(fresh_registry, inline_plugin):
    plugin = StubPlugin(OpCandidate)
    parallel, stack = _stack(plugin, inline_plugin)
    x = torch.randn(4, 32)
    backend = CountingBackend("aot_eager")
    out = torch.compile(stack, backend=backend, fullgraph=True)(x, Forward(parallel, 4))
    compiled_launches = plugin.launches()
    eager = stack(x, Forward(parallel, 4))
    eager_launches = plugin.launches() - compiled_launches
    assert torch.equal(out, eager)
    assert backend.graphs == 1 and graph_breaks() == 0
    assert backend.count(torch.ops.lb_fused_test.all_reduce_add_rmsnorm) == eager_launches == compiled_launches == 3
