"""cutedsl's local add + RMSNorm record ("cutedsl.add_rmsnorm") on a CPU: what it declines, and
its wrapper's parity and purity over the float64 reference kernels."""

import pytest
import torch

from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary.plugin import AddNormRequest, add_rms_norm, get_registry

from layer_boundary_cutedsl.local_add_norm import AddNormFactory, CuteAddNorm, factory
from layer_boundary_cutedsl.testing import reference_kernels


def _request(**changes):
    facts = dict(device=torch.device("cpu"), dtype=torch.bfloat16, contribution_dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                 hidden_size=4096, offset=0.0, eps=1e-6, compute_dtype=torch.float32, norm_kind="rms")
    facts.update(changes)
    return AddNormRequest(**facts)


def test_registered_on_by_default_above_flashinfer(fresh_registry):
    records = {r.name: r for r in get_registry().add_norm_kernels}
    assert "cutedsl.add_rmsnorm" in records
    names = [r.name for r in get_registry().add_norm_kernels]
    if "flashinfer.add_rmsnorm" in names:
        assert names.index("cutedsl.add_rmsnorm") < names.index("flashinfer.add_rmsnorm")


@pytest.mark.parametrize("changes,why", [
    ({}, "a cpu device"),
    ({"device": torch.device("meta")}, "a meta device"),
    ({"dtype": torch.float32, "contribution_dtype": torch.float32, "weight_dtype": torch.float32}, "float32 rows"),
    ({"contribution_dtype": torch.float32}, "differ in dtype"),
    ({"weight_dtype": torch.float32}, "differ in dtype"),
    ({"compute_dtype": torch.float64}, "statistics in torch.float64"),
    ({"hidden_size": 4100}, "width 4100"),
    ({"hidden_size": 32768}, "width 32768"),
    ({"offset": 0.5}, "weight offset 0.5"),
])
def test_declines_what_the_kernel_cannot_run(changes, why):
    request = _request(**changes)
    reason = factory.reason(request)
    assert reason is not None and why in reason
    assert factory(request) is None


def _rows(rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, hidden, generator=g) * 2).to(dtype), torch.randn(rows, hidden, generator=g).to(dtype)


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_kernel_matches_the_core_and_writes_nothing_it_reads(norm_cls, dtype):
    calls = []
    make = AddNormFactory(reference_kernels(calls))
    norm = norm_cls(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(0.5, 0.2)
    request = _request(dtype=dtype, contribution_dtype=dtype, weight_dtype=dtype, hidden_size=64, eps=1e-5, offset=norm.offset,
                       norm_kind="gemma_rms" if norm.offset else "rms")
    kernel = make(request)
    assert isinstance(kernel, CuteAddNorm)
    assert calls and calls[0][0] == "prepare" and calls[0][2]["offsets"] == (norm.offset,)
    for rows in (0, 1, 5, 33):
        c, r = _rows(rows, 64, dtype, seed=rows)
        held = (c.clone(), r.clone(), c._version, r._version)
        normed, new_residual = kernel(c, r, norm.weight)
        assert torch.equal(c, held[0]) and torch.equal(r, held[1]) and (c._version, r._version) == held[2:]
        want_normed, want_residual = add_rms_norm(norm, c, r)
        assert torch.equal(new_residual, want_residual)  # fp32 sum rounded once, both ways
        u = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -11
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=3 * u, atol=3 * u)
    assert [name for name, *_ in calls[1:]] == ["fused_add_rmsnorm"] * 4
    assert all(details["weight_offset"] == norm.offset and details["eps"] == 1e-5 for _, _, details in calls[1:])


def test_reference_kernel_takes_strided_rows():
    make = AddNormFactory(reference_kernels())
    kernel = make(_request(hidden_size=32))
    wide = torch.randn(4, 64).to(torch.bfloat16)
    c, r = wide[:, :32], wide[:, 32:]  # not contiguous: the wrapper copies before the launch
    w = torch.ones(32, dtype=torch.bfloat16)
    normed, new_residual = kernel(c, r, w)
    assert torch.equal(new_residual, (c.float() + r.float()).to(torch.bfloat16))


def test_compile_fails_declines_with_a_warning(caplog):
    from dataclasses import replace

    def broken(*args):
        raise RuntimeError("no compiler here")

    make = AddNormFactory(replace(reference_kernels(), prepare=broken))
    with caplog.at_level("WARNING", logger="layer_boundary.cutedsl"):
        assert make(_request()) is None
    assert "compile failed" in caplog.text and "no compiler here" in caplog.text


def test_custom_op_has_a_fake_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        c = torch.empty(3, 64, dtype=torch.bfloat16)
        normed, residual = torch.ops.layer_boundary_cutedsl.local_add_rmsnorm(c, c, torch.empty(64, dtype=torch.bfloat16), 1e-6, 0.0)
    assert normed.shape == residual.shape == (3, 64) and normed.dtype is torch.bfloat16


def test_torch_compile_fullgraph_traces_the_kernel_as_its_custom_op(fresh_registry):
    """Once chosen, the kernel is one custom-op node in a full graph (no break): the backend
    here only inspects the graph (the op's real implementation needs a GPU)."""
    norm = RMSNorm(64, dtype=torch.bfloat16)
    kernel = AddNormFactory(reference_kernels())(_request(hidden_size=64))
    norm.__dict__["_add_norm_kernels"] = {(torch.device("cpu"), torch.bfloat16, torch.bfloat16): lambda c, r: kernel(c, r, norm.weight)}
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lambda *args: [torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.bfloat16)]

    c, r = _rows(3, 64, torch.bfloat16)
    torch._dynamo.reset()
    try:
        torch.compile(lambda a, b: norm.fused_add_forward(a, b), fullgraph=True, backend=backend)(c, r)
    finally:
        torch._dynamo.reset()
    assert any("local_add_rmsnorm" in t for t in seen), seen
