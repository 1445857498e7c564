"""flashinfer's local add + RMSNorm record ("flashinfer.add_rmsnorm") on a CPU: what it declines,
and that its wrapper runs FlashInfer's in-place kernel on copies (the caller's tensors are never
written), with the reference numerics."""

import pytest
import torch

from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary.plugin import AddNormRequest, add_rms_norm, get_registry

from layer_boundary_flashinfer.local_add_norm import AddNormFactory, FlashInferAddNorm, factory
from layer_boundary_flashinfer.testing import reference_add_norm


def _request(**changes):
    facts = dict(device=torch.device("cpu"), dtype=torch.bfloat16, contribution_dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                 hidden_size=64, offset=0.0, eps=1e-6, compute_dtype=torch.float32, norm_kind="rms")
    facts.update(changes)
    return AddNormRequest(**facts)


def in_place_reference(log):
    """FlashInfer's contract: residual += input (rounded once), input = norm(sum) * (w + offset)."""

    def functions(offset):
        def run(input, residual, weight, eps):
            log.append((input.data_ptr(), residual.data_ptr(), offset))
            normed, new_residual = reference_add_norm(input, residual, weight, eps, offset)
            residual.copy_(new_residual)
            input.copy_(normed)

        return run

    return functions


def test_registered_as_a_vendor_kernel(fresh_registry):
    names = [r.name for r in get_registry().add_norm_kernels]
    assert "flashinfer.add_rmsnorm" in names


@pytest.mark.parametrize("changes,why", [
    ({}, "a cpu device"),
    ({"dtype": torch.float32, "contribution_dtype": torch.float32, "weight_dtype": torch.float32}, "float32 rows"),
    ({"contribution_dtype": torch.float32}, "differ in dtype"),
    ({"compute_dtype": torch.float64}, "statistics"),
    ({"offset": 2.0}, "weight offset"),
])
def test_declines_what_it_cannot_run(changes, why):
    request = _request(**changes)
    assert why in factory.reason(request)
    assert factory(request) is None


def test_switched_off_with_the_plugin_switch(monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_FLASHINFER", "0")
    make = AddNormFactory(in_place_reference([]), devices=("cpu",), implementation_of=lambda device: "reference")
    assert make.reason(_request()) == "LAYER_BOUNDARY_FLASHINFER=0"


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_on_copies_with_the_reference_numerics(norm_cls, dtype):
    log = []
    make = AddNormFactory(in_place_reference(log), devices=("cpu",), implementation_of=lambda device: "reference")
    norm = norm_cls(64, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(0.3, 0.2)
    kernel = make(_request(dtype=dtype, contribution_dtype=dtype, weight_dtype=dtype, offset=norm.offset))
    assert isinstance(kernel, FlashInferAddNorm) and kernel.implementation == "reference"
    assert len(log) == 1  # the factory's first launch (a build before any capture)
    g = torch.Generator().manual_seed(1)
    for rows in (0, 1, 7):
        c, r = torch.randn(rows, 64, generator=g).to(dtype), torch.randn(rows, 64, generator=g).to(dtype)
        held = (c.clone(), r.clone(), c._version, r._version)
        normed, new_residual = kernel(c, r, norm.weight)
        assert torch.equal(c, held[0]) and torch.equal(r, held[1]) and (c._version, r._version) == held[2:]
        if rows:
            assert log[-1][:2] != (c.data_ptr(), r.data_ptr()) and log[-1][2] == norm.offset
        want_normed, want_residual = add_rms_norm(norm, c, r)
        assert torch.equal(new_residual, want_residual)
        u = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -11
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=3 * u, atol=3 * u)
    assert len(log) == 3  # zero rows launch nothing


def test_a_first_launch_that_fails_declines(caplog):
    def functions(offset):
        def run(*args):
            raise RuntimeError("JIT build failed")

        return run

    make = AddNormFactory(functions, devices=("cpu",), implementation_of=lambda device: "reference")
    with caplog.at_level("WARNING", logger="layer_boundary.flashinfer"):
        assert make(_request()) is None
    assert "JIT build failed" in caplog.text


def test_custom_op_has_a_fake_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        c = torch.empty(3, 64, dtype=torch.float16)
        normed, residual = torch.ops.layer_boundary_flashinfer.local_add_rmsnorm(c, c, torch.empty(64, dtype=torch.float16), 1e-6, 1.0)
    assert normed.shape == residual.shape == (3, 64)


def test_torch_compile_fullgraph_traces_the_kernel_as_its_custom_op():
    from layer_boundary_flashinfer.local_add_norm import contract_factory

    norm = RMSNorm(64, dtype=torch.bfloat16)
    kernel = contract_factory()(_request())
    norm.__dict__["_add_norm_kernels"] = {(torch.device("cpu"), torch.bfloat16, torch.bfloat16): lambda c, r: kernel(c, r, norm.weight)}
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lambda *args: [torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.bfloat16)]

    c = torch.randn(3, 64).to(torch.bfloat16)
    torch._dynamo.reset()
    try:
        torch.compile(lambda a, b: norm.fused_add_forward(a, b), fullgraph=True, backend=backend)(c, c.clone())
    finally:
        torch._dynamo.reset()
    assert any("local_add_rmsnorm" in t for t in seen), seen


# ---------------------------------------------------------------- the plain norm (no add): norm_factory


def test_plain_norm_is_offered_and_declines_like_the_add_norm():
    from layer_boundary_flashinfer.local_add_norm import norm_factory

    record = next(r for r in get_registry().add_norm_kernels if r.name == "flashinfer.add_rmsnorm")
    assert record.record.norm_factory is not None
    request = _request()
    assert norm_factory.reason(request) == "a cpu device" and norm_factory(request) is None


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["rms", "gemma"])
def test_plain_norm_wrapper_runs_per_head_rows_out_of_place(offset):
    """Qwen3's q norm hands [T, heads, head_dim]: the kernel sees [T * heads, head_dim] rows and
    the result comes back in x's shape, a new tensor, with the kernels' numerics."""
    from layer_boundary_flashinfer.local_add_norm import NormFactory, reference_norm

    make = NormFactory(reference_norm, devices=("cpu",), implementation_of=lambda device: "reference")
    kernel = make(_request(hidden_size=16, offset=offset))
    x = torch.randn(3, 4, 16).to(torch.bfloat16)
    weight = (torch.rand(16) + 0.5).to(torch.bfloat16)
    before = x.clone()
    out = kernel(x, weight)
    assert out.shape == x.shape and out.data_ptr() != x.data_ptr() and torch.equal(x, before)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.float() + offset)).to(torch.bfloat16)
    assert torch.equal(out, want)
    assert kernel(x[:0], weight).shape == (0, 4, 16)


def test_plain_norm_takes_heads_of_a_fused_projection_as_they_are():
    """q or k heads sliced from a fused q/k/v GEMM's output have rows strided by the fused width:
    the kernel gets that 3-D view itself (FlashInfer's norms take any strides there), not a copy;
    the result is a new contiguous tensor with the kernels' numerics."""
    from layer_boundary_flashinfer.local_add_norm import NormFactory, reference_norm

    seen = []

    def spy(offset):
        run = reference_norm(offset)

        def call(rows, weight, eps):
            seen.append((rows.shape, rows.stride()))
            return run(rows, weight, eps)

        return call

    make = NormFactory(spy, devices=("cpu",), implementation_of=lambda device: "reference")
    kernel = make(_request(hidden_size=16))
    fused = torch.randn(3, 6 * 16).to(torch.bfloat16)
    x = fused[:, 16:48].view(3, 2, 16)
    weight = (torch.rand(16) + 0.5).to(torch.bfloat16)
    out = kernel(x, weight)
    assert seen[-1] == ((3, 2, 16), (96, 16, 1))  # the view itself: no copy before the kernel
    assert out.is_contiguous() and out.shape == (3, 2, 16)
    xf = x.float()
    assert torch.equal(out, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(torch.bfloat16))


def test_plain_norm_custom_op_has_a_fake_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from layer_boundary_flashinfer import local_add_norm  # noqa: F401 - registers the op

    with FakeTensorMode():
        out = torch.ops.layer_boundary_flashinfer.local_rmsnorm(torch.empty(2, 8, 128, dtype=torch.bfloat16), torch.empty(128, dtype=torch.bfloat16), 1e-6, 0.0)
    assert out.shape == (2, 8, 128) and out.dtype == torch.bfloat16
