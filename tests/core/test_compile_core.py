"""The boundaries inside `torch.compile(fullgraph=True)`: guards and recompiles, the error table,
collectives as graph nodes (ours and an engine's own), on the `bench host` stack (no model code
around the boundaries)."""

import pytest
import torch
from torch import nn

from layer_boundary import Forward, ForwardMode, Parallel, RMSNorm, Topology, declare_attn, declare_ffn, layer_stack, make_stages, residual_batch
from layer_boundary._residual.add_norm import prepare_norms
from layer_boundary.bench.host import Stack
from layer_boundary.collectives import CollectivesBase
from layer_boundary.compiling import CountingBackend, compile_model, graph_breaks, reset_graph_breaks


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    reset_graph_breaks()
    yield
    torch._dynamo.reset()


def compiled(fn, backend="eager"):
    counter = CountingBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


# guards and recompiles ---------------------------------------------------------------------------


@torch.inference_mode()
def test_decode_with_a_dynamic_token_count_compiles_a_bounded_number_of_times():
    stack = Stack(64, 4).eval()
    step, counter = compiled(lambda x, fwd: stack.boundary_forward(x, fwd=fwd))
    for tokens in range(1, 257):
        x = torch.randn(tokens, 64)
        torch._dynamo.mark_dynamic(x, 0, min=1, max=256) if tokens > 1 else None
        fwd = Forward(stack.parallel, tokens, mode=ForwardMode.DECODE)
        assert torch.equal(step(x, fwd), stack.boundary_forward(x, fwd=Forward(stack.parallel, tokens, mode=ForwardMode.DECODE)))
    print(f"token counts 1..256: {counter.graphs} graphs")
    assert counter.graphs <= 3  # one row (specialised), then one graph for every other count
    assert graph_breaks() == 0


@pytest.mark.parametrize("reduction", ["ar", "rs+rsv"])
@torch.inference_mode()
def test_a_batch_variant_change_recompiles_once_not_every_step(reduction):
    parallel = Parallel.create(Topology(tp=2), 0, MirrorCollectives)
    stack = TP2Stack(parallel, reduction=reduction).eval()
    # the norms' add + norm kernels are chosen before compiling, as prepare_model does: a choice
    # made by the first eager call after a compiled one changes what the graph guards on
    prepare_norms(stack)
    step, counter = compiled(stack)
    x = torch.randn(8, 32)
    seen = []
    for i in range(8):  # alternating sequence-parallel and ordinary batches, each shape the same
        sp = bool(i % 2)
        fwd = Forward(parallel, 8, sequence_parallel=sp)
        out = step(x, fwd)
        assert torch.equal(out, stack(x, Forward(parallel, 8, sequence_parallel=sp)))
        seen.append(counter.graphs)
    print(f"{reduction}: alternating variants, graphs after each step: {seen}")
    assert seen == [1] + [2] * 7
    assert graph_breaks() == 0


# the error table ---------------------------------------------------------------------------------


def _foreign_output(stack, x):
    fwd = Forward(stack.parallel, x.shape[0])
    residual_batch.start(fwd)
    layer = stack.layers[0]
    h = layer.attn_boundary.prepare(x, fwd)
    layer.attn_boundary.finish(layer.attn(h), fwd)
    return layer.ffn_boundary.prepare(h * 2, fwd)  # not the handle finish() returned


def _not_started(stack, x):
    fwd = Forward(stack.parallel, x.shape[0])
    return stack.layers[0].attn_boundary.prepare(x, fwd)


@pytest.mark.parametrize("bad", [_foreign_output, _not_started], ids=["foreign-output", "not-started"])
@torch.inference_mode()
def test_the_error_table_holds_under_compile(bad):
    stack = Stack(64, 2).eval()
    x = torch.randn(4, 64)
    with pytest.raises(Exception) as eager:
        bad(stack, x)
    with pytest.raises(type(eager.value)) as traced:
        compile_model(lambda x: bad(stack, x), backend="eager")(x)
    assert str(traced.value) == str(eager.value)


# collectives as graph nodes ------------------------------------------------------------------------


class MirrorCollectives(CollectivesBase):
    """Rank 0 of a group whose other ranks hold the same partials: an all-reduce doubles."""

    def __init__(self, name, ranks):
        self.name, self.ranks, self.size, self.rank = name, tuple(ranks), len(ranks), 0

    #: all-reduces issued eagerly (by every instance)
    issued = 0

    def _all_reduce(self, x):
        if not torch.compiler.is_compiling():  # folded while tracing: torch 2.11 cannot trace a class setattr
            MirrorCollectives.issued += 1
        return x * self.size

    def _reduce_scatter(self, x):
        return (x * self.size)[: x.shape[0] // self.size]

    def _all_gather(self, x):
        return torch.cat([x] * self.size)


@torch.library.custom_op("lb_compile_test::engine_all_reduce", mutates_args=())
def engine_all_reduce(x: torch.Tensor, world: int) -> torch.Tensor:
    return x * world  # an engine's own kernel (here: the mirror world's sum)


@engine_all_reduce.register_fake
def _(x, world):
    return torch.empty_like(x)


class EngineCollectives(MirrorCollectives):
    """An engine's Collectives whose all-reduce is its own registered op: traced as written."""

    graph_native = True

    def _all_reduce(self, x):
        if not torch.compiler.is_compiling():  # folded while tracing: torch 2.11 cannot trace a class setattr
            MirrorCollectives.issued += 1
        return torch.ops.lb_compile_test.engine_all_reduce(x, self.size)


class TP2Stack(nn.Module):
    def __init__(self, parallel, hidden=32, layers=2, reduction="ar"):
        super().__init__()
        self.parallel = parallel
        self.layers = nn.ModuleList()
        with layer_stack(parallel, reduction=reduction):
            for i in range(layers):
                layer = nn.Module()
                layer.attn, layer.mlp = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
                layer.n1, layer.n2 = RMSNorm(hidden), RMSNorm(hidden)
                layer.attn_boundary, layer.ffn_boundary = make_stages(
                    (declare_attn(), layer.n1), (declare_ffn(), layer.n2),
                    previous=declare_ffn() if i else None, terminal=i == layers - 1,
                )
                self.layers.append(layer)
        self.norm = RMSNorm(hidden)

    def forward(self, x, fwd):
        residual_batch.start(fwd)
        h = x
        for layer in self.layers:
            h = layer.attn_boundary.prepare(h, fwd)
            h = layer.attn_boundary.finish(layer.attn(h), fwd)  # a partial sum: the boundary reduces it
            h = layer.ffn_boundary.prepare(h, fwd)
            with layer.ffn_boundary.exit(fwd) as out:
                y = layer.mlp(h)
            h = out.finish(y)
        return residual_batch.norm(h, fwd, self.norm)


@pytest.mark.parametrize(
    "groups, op",
    [
        (MirrorCollectives, torch.ops.layer_boundary.all_reduce),  # opaque to the tracer: our op runs it
        (EngineCollectives, torch.ops.lb_compile_test.engine_all_reduce),  # the engine's op, traced as written
    ],
    ids=["layer_boundary-op", "engine-op"],
)
@torch.inference_mode()
def test_all_reduces_are_graph_nodes(groups, op):
    parallel = Parallel.create(Topology(tp=2), 0, groups)
    torch.manual_seed(0)
    stack = TP2Stack(parallel).eval()
    x = torch.randn(4, 32)
    step, counter = compiled(stack)
    out = step(x, Forward(parallel, 4))
    MirrorCollectives.issued = 0
    assert torch.equal(out, stack(x, Forward(parallel, 4)))
    assert counter.graphs == 1 and graph_breaks() == 0
    assert counter.count(op) == MirrorCollectives.issued > 0  # one graph node per all-reduce the eager call issues


@torch.inference_mode()
def test_inductor_agrees_with_eager_in_float32():
    """Inductor fuses the norms and adds (other roundings): equal to float32 tolerance."""
    stack = Stack(64, 2).eval()
    step, counter = compiled(lambda x: stack.boundary_forward(x), backend="inductor")
    x = torch.randn(8, 64)
    out, want = step(x), stack.boundary_forward(x)
    assert counter.graphs == 1 and graph_breaks() == 0
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5), (out - want).abs().max()
