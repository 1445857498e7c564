"""Post-norm and sandwich layers keep the deferred, fused completion: an output norm
(`OutputTransform(norm)`) waits with its sum for the next input, which completes the sum, norms
it, adds and reads in one call (a candidate with `post_norm_kinds`, or the core's unfused one;
a complete output's `Stage.read_complete`, whose kernel is an `AddNormKernel.post_norm_factory`).
Threaded world, float64, against a serial stack."""

import pytest
import torch
from torch import nn

from layer_boundary import (
    Forward,
    FusedMlpInput,
    FusionError,
    GemmaRMSNorm,
    LayerNorm,
    OutputTransform,
    Parallel,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_stages,
    residual_batch,
)
from layer_boundary._fusions import offered_here
from layer_boundary._residual.stream import OwedOutput
from layer_boundary.plugin import AddNormKernel, PostNormRequest, hookimpl, unregister_inline
from layer_boundary.testing.threaded import run_threaded

H = 16


class Identity(nn.Module):
    """A post-norm layer's read: the residual as it is, naming its width."""

    norm_kind = "none"

    def __init__(self, hidden):
        super().__init__()
        self.hidden_size = hidden

    def forward(self, x):
        return x


def _norm(kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return Identity(H)
    if kind == "layer":
        norm = LayerNorm(H, bias=True, dtype=torch.float64, compute_dtype=None)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64))
            norm.bias.copy_(0.2 * torch.randn(H, generator=g, dtype=torch.float64))
        return norm
    cls = GemmaRMSNorm if kind == "gemma_rms" else RMSNorm
    norm = cls(H, dtype=torch.float64, compute_dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_((0.0 if kind == "gemma_rms" else 1.0) + 0.2 * torch.randn(H, generator=g, dtype=torch.float64))
    return norm


#: (read kind, post kind): Gemma's sandwich, OLMo-2's post-norm, LayerNorm around LayerNorm
SHAPES = {"sandwich": ("gemma_rms", "gemma_rms"), "post_norm": ("none", "rms"), "layer": ("layer", "layer")}


def _weights(layers):
    return [torch.randn(H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(40 + i)) / H for i in range(2 * layers)]


def _norms(shape, layers):
    read, post = SHAPES[shape]
    reads = [_norm(read, 10 + i) for i in range(2 * layers)]
    posts = [_norm(post, 100 + i) for i in range(2 * layers)]
    final = _norm("rms", 7)
    return reads, posts, final


def _stack_rank(parallel, shape, layers=2, rows=5, fusions=None, record_handles=None):
    """`layers` layers of an attention (declared partial sum) and an FFN, each output normed by its
    post-norm before the add; each rank computes its share of a linear map."""
    tp = parallel.groups["tp"]
    reads, posts, final = _norms(shape, layers)
    weights = _weights(layers)
    transforms = [OutputTransform(p, name=f"post{i}") for i, p in enumerate(posts)]
    options = {} if fusions is None else {"fusions": fusions}
    stages = []
    with layer_stack(parallel, reduction="ar"):
        previous = None
        for i in range(layers):
            pair = make_stages(
                (declare_attn(output_transform=transforms[2 * i]), reads[2 * i], options),
                (declare_ffn(output_transform=transforms[2 * i + 1]), reads[2 * i + 1], options),
                previous=previous, terminal=i == layers - 1, label=f"layer{i}",
            )
            previous = pair[1].declaration
            stages.append(pair)
    x = torch.randn(rows, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    fwd = Forward(parallel, rows)
    residual_batch.start(fwd)
    h = x
    for i, (attn, ffn) in enumerate(stages):
        h = attn.prepare(h, fwd)
        h = attn.finish(h @ weights[2 * i].T / tp.size, fwd)
        if record_handles is not None:
            record_handles.append(h)
        h = ffn.prepare(h, fwd)
        with ffn.exit(fwd) as out:
            y = h @ weights[2 * i + 1].T
            y = y / tp.size if out.fuse_mlp_allreduce else y
        h = out.finish(y)
    return residual_batch.norm(h, fwd, final), [s for pair in stages for s in pair]


def _serial(shape, layers=2, rows=5):
    reads, posts, final = _norms(shape, layers)
    weights = _weights(layers)
    h = torch.randn(rows, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i in range(2 * layers):
        h = h + posts[i](reads[i](h) @ weights[i].T)
    return final(h)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tp", [1, 2])
def test_post_norm_stacks_match_a_serial_stack(tp, shape):
    results = run_threaded(lambda p: _stack_rank(p, shape)[0], Topology(tp=tp))
    want = _serial(shape)
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_ffn_defers_its_sum_and_its_post_norm_to_the_next_input():
    (_, stages), _ = run_threaded(lambda p: _stack_rank(p, "sandwich"), Topology(tp=2))
    attn0, ffn0, attn1, ffn1 = (s.plan for s in stages)
    ordinary = {p: p.paths[next(iter(p.paths))] for p in (attn0, ffn0, attn1, ffn1)}
    assert ordinary[ffn0].exit.may_defer and ordinary[ffn0].exit.keeps_post_norm
    assert not ordinary[ffn1].exit.may_defer and ordinary[ffn1].exit.keeps_post_norm  # terminal: the final norm takes it
    assert ordinary[attn1].entry.post_transform is ffn0.declaration.output_transform
    assert ordinary[ffn0].entry.post_transform is attn0.declaration.output_transform
    assert ffn0.description.post_norm_kind == "gemma_rms" and attn0.description.post_norm_kind is None
    assert ffn0.post_norm is attn0.declaration.output_transform.post_norm


def test_a_transform_that_is_no_norm_still_completes_at_the_exit():
    half = OutputTransform(lambda x: x * 0.5, name="half")
    assert half.post_norm is None
    with layer_stack(Parallel.single()):
        attn, ffn = make_stages((declare_attn(output_transform=half), RMSNorm(H)), (declare_ffn(output_transform=half), RMSNorm(H)),
                                terminal=True)
    path = ffn.plan.paths[next(iter(ffn.plan.paths))]
    assert not path.exit.keeps_post_norm and path.entry.post_transform is None and not path.entry.candidates
    assert ffn.plan.post_norm is None and "post_norm" not in ffn.plan.describe()


def test_over_one_rank_the_exit_leaves_the_post_norm_pending():
    handles = []
    run_threaded(lambda p: _stack_rank(p, "post_norm", record_handles=handles), Topology())
    assert handles and all(isinstance(h, OwedOutput) for h in handles)  # the output still owes its norm


# --- a fusion provider's post-norm candidate -------------------------------------------------------


class PostNormProvider:
    """A provider with one candidate for post-norm inputs: the sum over its group, then the
    stage's own local completion (`Stage.read_complete`); it records every call."""

    def __init__(self, calls):
        self.calls = calls

    def attention_input(self, stage):
        def run(owed, residual, forward):
            self.calls.append(stage.label)
            return stage.read_complete(owed.group.all_reduce(owed.partial), residual)

        return (FusedMlpInput(run=run, name="test.post_norm", preserves_residual=True, norm_kinds=("rms", "gemma_rms", "layer", "none"),
                              post_norm_kinds=("rms", "gemma_rms", "layer")),)

    ffn_input = attention_input


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_post_norm_candidate_completes_both_sums_of_every_layer_but_the_last(shape):
    layers = 3
    calls = [[] for _ in range(2)]
    plain = run_threaded(lambda p: _stack_rank(p, shape, layers)[0], Topology(tp=2))
    fused = run_threaded(lambda p: _stack_rank(p, shape, layers, fusions=PostNormProvider(calls[p.rank]))[0], Topology(tp=2))
    for a, b in zip(plain, fused):
        assert torch.equal(a, b)  # the same operations as the unfused completion
    # the attention's declared sum at every FFN input, the FFN's deferred sum at the next
    # attention input; the last FFN completes in its exit, for the final norm
    want = [f"layer{i}.1:ffn" if j == 1 else f"layer{i}.0:attention" for i in range(layers) for j in (0, 1) if (i, j) != (0, 0)]
    assert calls[0] == calls[1] == want


def test_candidates_are_offered_only_for_their_post_norm_kinds():
    (_, stages), _ = run_threaded(lambda p: _stack_rank(p, "sandwich"), Topology(tp=2))
    ffn = stages[1].plan

    def offered(**fields):
        return offered_here(FusedMlpInput(run=lambda *a: None, name="test.c", **fields), ffn.description)

    assert not offered()  # takes no post-norm: not offered where one arrives
    assert not offered(post_norm_kinds=("rms",))  # another kind
    assert offered(post_norm_kinds=("gemma_rms",))
    assert not offered(post_norm_kinds=("gemma_rms",), norm_kinds=("rms",))  # the read is Gemma's
    assert not offered_here(FusedMlpInput(run=lambda *a: None, post_norm_kinds=("gemma_rms",)), stages[0].plan.description)


# --- the local post-norm + add + norm kernel ---------------------------------------------------------


class PostNormKernels:
    """An inline `AddNormKernel` with a `post_norm_factory` over torch (the reference math: the
    post-norm rounded once, the add in fp64, the read's norm); it logs requests and calls."""

    def __init__(self):
        self.requests, self.calls = [], []

    def post_norm_factory(self, request: PostNormRequest):
        self.requests.append(request)

        def run(contribution, residual, post_weight, post_bias, weight, bias):
            self.calls.append(contribution.shape[0])
            post = _apply(request.post, contribution, post_weight, post_bias)
            total = residual + post
            return (total if weight is None else _apply(request.norm, total, weight, bias)), total

        return run

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        yield AddNormKernel(name="postnorms.k", factory=lambda request: None, post_norm_factory=self.post_norm_factory, priority=300,
                            norm_kinds=("rms", "gemma_rms", "layer"), description="post-norm + add + norm in torch")


def _apply(spec, x, weight, bias):
    if spec.norm_kind == "layer":
        centered = x - x.mean(-1, keepdim=True)
        y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + spec.eps) * weight
        return y if bias is None else y + bias
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps) * (weight + spec.offset)


@pytest.fixture
def post_kernels(fresh_registry, inline_plugin):
    return inline_plugin(PostNormKernels(), name="postnorms")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_over_one_rank_every_completion_is_one_post_norm_call(post_kernels, shape):
    layers = 3
    got, stages = _stack_rank(Parallel.single(), shape, layers)
    torch.testing.assert_close(got, _serial(shape, layers), rtol=1e-12, atol=1e-12)
    # two completions a layer: the attention output at the FFN input, the FFN output at the next
    # input (the last one at the final norm)
    assert post_kernels.calls == [5] * (2 * layers)
    read, post = SHAPES[shape]
    kinds = {(r.post.norm_kind, r.norm.norm_kind) for r in post_kernels.requests}
    assert kinds == {(post, read), (post, "rms")}  # the stages' reads, and the final RMSNorm
    assert all(r.post.bias == (post == "layer") for r in post_kernels.requests)
    described = stages[1].plan.describe()["post_norm"]
    assert "in one call: postnorms.k" in described


def test_a_read_no_kernel_computes_runs_the_torch_completion(post_kernels):
    with layer_stack(Parallel.single()):
        _, ffn = make_stages((declare_attn(output_transform=OutputTransform(_norm("rms", 1))), _norm("rms", 2)),
                             (declare_ffn(), nn.LayerNorm(H, dtype=torch.float64)), terminal=True)
    choice = ffn.plan.read_complete.choose(torch.device("cpu"), torch.float64, torch.float64)
    assert choice.name == "core.torch" and "not a norm kernels reproduce" in choice.reason
    assert post_kernels.requests == []
    with layer_stack(Parallel.single()):
        _, ffn = make_stages((declare_attn(output_transform=OutputTransform(_norm("rms", 1))), _norm("rms", 2)),
                             (declare_ffn(), _norm("rms", 3)), terminal=True)
    assert ffn.plan.read_complete.choose(torch.device("cpu"), torch.float64, torch.float64).name == "postnorms.k"
    unregister_inline("postnorms")  # the choice is forgotten with the registry: the torch completion runs
    assert ffn.plan.read_complete.choose(torch.device("cpu"), torch.float64, torch.float64).name == "core.torch"


def test_a_layer_norm_kernel_receives_its_bias(fresh_registry, inline_plugin):
    seen = []

    class LayerKernels:
        @hookimpl
        def layer_boundary_add_norm_kernels(self):
            def factory(request):
                def run(contribution, residual, weight, bias):
                    seen.append((request.bias, bias))
                    return LayerNorm.add_forward(norm, contribution, residual)

                return run

            yield AddNormKernel(name="layers.k", factory=factory, priority=300, norm_kinds=("layer",), description="LayerNorm")

    inline_plugin(LayerKernels(), name="layers")
    for bias in (True, False):
        norm = LayerNorm(H, bias=bias, dtype=torch.float64)
        c, r = torch.randn(2, H, dtype=torch.float64), torch.randn(2, H, dtype=torch.float64)
        got = norm.fused_add_forward(c, r)
        assert torch.equal(got[1], norm.add_forward(c, r)[1]) and norm.add_norm_kernel() == "layers.k"
        assert seen[-1] == (bias, norm.bias)


def test_prepare_model_chooses_the_post_norm_kernel_before_the_first_forward(post_kernels):
    """Every plan of a stage shares one post-norm read, kept on its read norm, where
    `prepare_model` (its `prepare_norms`) finds and chooses it: no choice is left for a capture."""
    from layer_boundary._residual.add_norm import prepare_norms

    holder = nn.Module()
    holder.post, holder.read = _norm("rms", 1), _norm("gemma_rms", 2)
    with layer_stack(Parallel.single()):
        _, ffn = make_stages((declare_attn(output_transform=OutputTransform(holder.post)), _norm("rms", 3)), (declare_ffn(), holder.read),
                             terminal=True)
    assert ffn.plan.read_complete is ffn.plan.paths[next(iter(ffn.plan.paths))].entry.read_complete
    chosen = dict(prepare_norms(holder))
    assert chosen["read (after RMSNorm)"] == "postnorms.k" and len(post_kernels.requests) == 1


class SpoiledPostNormKernels(PostNormKernels):
    """The same kernel, its new residual cut to one row (it would broadcast into the next add)."""

    def post_norm_factory(self, request: PostNormRequest):
        run = super().post_norm_factory(request)
        return lambda *args: (lambda normed, residual: (normed, residual[:1]))(*run(*args))


def test_a_wrong_post_norm_result_fails_at_the_kernel_naming_its_plugin(fresh_registry, inline_plugin):
    inline_plugin(SpoiledPostNormKernels(), name="postnorms")
    with pytest.raises(FusionError) as info:
        _stack_rank(Parallel.single(), "sandwich", 2)
    message = str(info.value)
    assert message.startswith("post-norm + add + norm kernel record 'postnorms.k' of plugin 'postnorms'"), message
    assert "wrong new residual: 1 row where" in message
    assert message.endswith("set LAYER_BOUNDARY_DISABLE_PLUGINS=postnorms to run without it")
