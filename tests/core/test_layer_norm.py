"""LayerNorm as a stage read: its numerics, its add + norm through the boundaries (threaded
world, float64, against a serial reference), the hidden-size check for every kind of norm
module, and that a LayerNorm is never handed to a kernel that implements RMSNorm."""

import pytest
import torch
from torch import nn

from layer_boundary import (
    Forward,
    LayerNorm,
    Parallel,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import AddNormKernel, AddNormRequest, get_registry, hookimpl
from layer_boundary.testing.threaded import run_threaded

from layer_boundary._residual import kernels


def _rows(rows=5, hidden=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype)


def _layer_norm(hidden=16, *, bias=True, compute_dtype=torch.float32, dtype=torch.float64, seed=1):
    norm = LayerNorm(hidden, 1e-5, bias=bias, dtype=dtype, compute_dtype=compute_dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64))
        if bias:
            norm.bias.copy_(0.1 * torch.randn(hidden, generator=g, dtype=torch.float64))
    return norm


@pytest.mark.parametrize("bias", [True, False])
def test_wide_statistics_match_torch_layer_norm_in_float64(bias):
    """compute_dtype=None: the statistics in float64 for float64 rows, as torch.nn.LayerNorm."""
    norm = _layer_norm(bias=bias, compute_dtype=None)
    ref = nn.LayerNorm(16, eps=1e-5, bias=bias, dtype=torch.float64)
    ref.load_state_dict(norm.state_dict())
    x = _rows()
    torch.testing.assert_close(norm(x), ref(x), rtol=1e-14, atol=1e-14)
    assert norm.hidden_size == 16 and norm.norm_kind == "layer"


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_statistics_round_through_float32_once(bias):
    """The default (fp32 statistics, affine in fp32, one rounding): the norm of a model that casts
    to float32 first, even in a float64 model (Cohere's)."""
    norm = _layer_norm(bias=bias)
    x = _rows()
    x32 = x.float()
    centered = x32 - x32.mean(-1, keepdim=True)
    want = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    if bias:
        want = want + norm.bias.float()
    assert torch.equal(norm(x), want.double())
    assert norm(x[:0]).shape == (0, 16)


def test_add_forward_norms_the_unrounded_sum_and_rounds_the_residual_once():
    norm = _layer_norm(dtype=torch.bfloat16)
    c, r = _rows(dtype=torch.bfloat16), _rows(seed=2, dtype=torch.bfloat16)
    normed, new_residual = norm.add_forward(c, r)
    total = c.float() + r.float()
    assert torch.equal(new_residual, total.to(torch.bfloat16))
    assert torch.equal(normed, norm.torch_forward(total).to(torch.bfloat16))
    fused = norm.fused_add_forward(c, r)
    assert torch.equal(fused[0], normed) and torch.equal(fused[1], new_residual)


# --- through the boundaries ----------------------------------------------------------------------

H = 16


def _stack_rank(parallel, layers, rows, bias):
    """`layers` pre-norm layers (attention partial + dense FFN) with LayerNorm reads and a
    LayerNorm final norm: each rank's compute is its share of a linear map, summed by the
    boundaries."""
    tp = parallel.groups["tp"]
    norms = [_layer_norm(H, bias=bias, seed=10 + i) for i in range(2 * layers + 1)]
    weights = [torch.randn(H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + i)) / H for i in range(2 * layers)]
    with layer_stack(parallel, reduction="ar"):
        stages = [
            make_stages(
                (declare_attn(), norms[2 * i]),
                (declare_ffn(), norms[2 * i + 1]),
                previous=declare_ffn() if i else None,
                terminal=i == layers - 1,
                label=f"layer{i}",
            )
            for i in range(layers)
        ]
    x = _rows(rows, H, seed=3)
    fwd = Forward(parallel, rows)
    residual_batch.start(fwd)
    h = x
    for i, (attn, ffn) in enumerate(stages):
        h = attn.prepare(h, fwd)
        h = attn.finish(h @ weights[2 * i].T / tp.size, fwd)  # each rank a share of the sum
        h = ffn.prepare(h, fwd)
        with ffn.exit(fwd) as out:
            y = h @ weights[2 * i + 1].T
            y = y / tp.size if out.fuse_mlp_allreduce else y
        h = out.finish(y)
    return residual_batch.norm(h, fwd, norms[-1]), [s.plan for pair in stages for s in pair]


def _serial(layers, rows, bias):
    norms = [_layer_norm(H, bias=bias, seed=10 + i) for i in range(2 * layers + 1)]
    weights = [torch.randn(H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + i)) / H for i in range(2 * layers)]
    h = _rows(rows, H, seed=3)
    for i in range(layers):
        h = h + norms[2 * i](h) @ weights[2 * i].T
        h = h + norms[2 * i + 1](h) @ weights[2 * i + 1].T
    return norms[-1](h)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_layer_norm_reads_through_the_boundaries_match_a_serial_stack(tp, bias):
    results = run_threaded(lambda p: _stack_rank(p, 2, 5, bias)[0], Topology(tp=tp))
    want = _serial(2, 5, bias)
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_layer_norm_stage_binds_its_own_add_norm_and_says_layer():
    _, plans = _stack_rank(Parallel.single(), 1, 3, True)
    attn, ffn = plans
    assert ffn.description.norm_kind == "layer" and ffn.hidden_size == H
    entry = ffn.paths[next(iter(ffn.paths))].entry
    assert entry.add_norm is not None and entry.add_norm.__self__ is ffn.norm  # the lean entry runs its add + norm
    # a candidate computing RMSNorm is never offered to a LayerNorm: only the unfused completion here
    assert [c.name for c in entry.candidates] == ["core.unfused"]


# --- the hidden-size check -----------------------------------------------------------------------


class Named(nn.Module):
    """A read that normalizes nothing, naming its width."""

    def __init__(self, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, x):
        return x


@pytest.mark.parametrize(
    "norm",
    [nn.LayerNorm(H), nn.LayerNorm(H, elementwise_affine=False), nn.RMSNorm(H), LayerNorm(H, bias=False), RMSNorm(H), Named(H)],
    ids=["nn.LayerNorm", "nn.LayerNorm-no-affine", "nn.RMSNorm", "LayerNorm", "RMSNorm", "hidden_size"],
)
def test_every_norm_module_gets_its_hidden_size_checked(norm):
    parallel = Parallel.single()
    with layer_stack(parallel):
        (attn,) = make_stages((declare_attn(), norm), terminal=True)
    assert attn.plan.hidden_size == H
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.prepare(torch.ones(3, H), fwd)
    with pytest.raises(ValueError, match=f"hidden size {H + 1}, but the stage's norm has {H}"):
        attn.finish(torch.ones(3, H + 1), fwd)
    del h


@pytest.mark.parametrize(
    "norm, message",
    [
        (nn.Identity(), r"cannot tell the hidden size of its norm \(Identity\): give the module a `hidden_size`"),
        (None, r"cannot tell the hidden size of its norm \(NoneType\)"),
        (nn.LayerNorm((4, H)), r"normalizes over \[4, 16\]"),
    ],
    ids=["identity", "none", "two-dims"],
)
def test_a_norm_without_a_hidden_size_fails_at_construction_naming_the_stage(norm, message):
    with layer_stack(Parallel.single()):
        with pytest.raises(ValueError, match=message) as info:
            make_stages((declare_attn(), norm), terminal=True, label="first")
    assert "stage first" in str(info.value)


# --- plugin kernels only get the norm kinds they declare -----------------------------------------


class EveryRequest:
    """An add + norm record that accepts every request it is asked (as RMSNorm kernels that
    check only offsets, dtypes and widths do), with and without declaring the LayerNorm kind."""

    def __init__(self):
        self.asked = []
        self.records = [
            AddNormKernel(name="rms_only.k", factory=self._factory("rms_only.k"), priority=300, description="rms kinds"),
            AddNormKernel(name="layer_too.k", factory=self._factory("layer_too.k"), priority=200, description="rms and layer",
                          norm_kinds=("rms", "gemma_rms", "layer")),
        ]

    def _factory(self, name):
        def factory(request):
            self.asked.append((name, request.norm_kind))
            return lambda contribution, residual, weight: (residual, residual)

        return factory

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        return self.records


def _request(kind):
    return AddNormRequest(device=torch.device("cpu"), dtype=torch.float32, contribution_dtype=torch.float32,
                          weight_dtype=torch.float32, hidden_size=H, offset=0.0, eps=1e-5, compute_dtype=torch.float32,
                          norm_kind=kind)


def test_a_kind_a_record_does_not_declare_is_never_handed_to_it(fresh_registry, inline_plugin):
    plugin = inline_plugin(EveryRequest(), name="everyrequest")
    assert kernels._ask(_request("rms")).chosen.candidate == "rms_only.k"
    chosen = kernels._ask(_request("layer"))
    name, declined = chosen.chosen.candidate, [a.candidate for a in chosen.declined]
    assert name == "layer_too.k" and "rms_only.k" in declined
    # the installed plugins' RMSNorm kernels (flashinfer, cutedsl) declare no LayerNorm either
    rms_records = [i.name for i in get_registry().add_norm_kernels if "layer" not in i.record.norm_kinds]
    assert set(rms_records) - {"rms_only.k"} <= set(declined)
    assert ("rms_only.k", "layer") not in plugin.asked  # declined without asking its factory
    # a LayerNorm in a model asks only the records that declare its kind, with its bias
    plugin.asked.clear()
    norm = _layer_norm(H, dtype=torch.float32)
    assert norm.add_norm_kernel() == "layer_too.k" and plugin.asked == [("layer_too.k", "layer")]
