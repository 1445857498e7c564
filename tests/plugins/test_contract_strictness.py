"""The contract suite is as strict as the models: its add + norm cases ask every (dtype, norm
statistic dtype) pair the shipped models request, so a kernel that ignores the statistic dtype
(and would fail `run --dtype float64` against Hugging Face) fails here; a vendor's wrong-shaped or
wrong-dtype return fails with the message a run raises, word for word; and the pytest plugin
registers the `gpu` mark its CUDA cases carry."""

import subprocess
import sys
import textwrap

import pytest
import torch

from layer_boundary import (
    Forward,
    FusedMlpInput,
    FusionError,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    hookimpl,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import AddNormKernel, FusionProvider, add_rms_norm
from layer_boundary.testing.contract import ContractSettings, ContractViolation, check_add_norm_kernel, check_fusion_provider
from layer_boundary.testing.threaded import run_threaded

H = 64
ROWS = 5


def widest_statistics(request):
    """Add + RMSNorm (plain weight) with the statistic in max(rows, float32), whatever the request
    asked: right for every dtype the suite asked before, wrong for float64 rows whose norm asks
    float32 statistics."""
    if request.norm_kind != "rms":
        return None

    def kernel(contribution, residual, weight):
        wide = torch.promote_types(residual.dtype, torch.float32)
        total = contribution.to(wide) + residual.to(wide)
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + request.eps)
        return weight * normed.to(residual.dtype), total.to(residual.dtype)

    return kernel


def test_a_kernel_ignoring_the_statistic_dtype_fails_the_models_float64_case(fresh_registry, inline_plugin):
    record = AddNormKernel(name="acme.add_rmsnorm", factory=widest_statistics, description="test")
    with pytest.raises(ContractViolation) as info:
        check_add_norm_kernel(record)
    failures = [line for line in str(info.value).splitlines() if line.startswith("  - ")]
    assert failures and all("float64 (statistics in float32)" in line and "[parity]" in line for line in failures)
    # what those failures stand for: a float64 model's norm (statistics in float32, as every
    # shipped model builds it) through this kernel misses the float64 tolerance of run's check
    class Plugin:
        @hookimpl
        def layer_boundary_add_norm_kernels(self):
            yield record

    inline_plugin(Plugin(), name="acme")
    norm = RMSNorm(H, dtype=torch.float64)
    assert norm.compute_dtype == torch.float32 and norm.add_norm_kernel() == "acme.add_rmsnorm"
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(ROWS, H, generator=g, dtype=torch.float64), torch.randn(ROWS, H, generator=g, dtype=torch.float64)
    got, want = norm.fused_add_forward(c, r)[0], norm.add_forward(c, r)[0]
    assert (got - want).abs().max().item() / want.abs().max().item() > 1e-10


class AddNormPlugin:
    def __init__(self, spoil):
        def kernel(contribution, residual, weight):
            return spoil(*add_rms_norm(_norm_like(weight, residual.dtype), contribution, residual))

        self.record = AddNormKernel(name="acme.add_rmsnorm", factory=lambda request: kernel, priority=400, description="test")

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        yield self.record


def _norm_like(weight, dtype):
    norm = RMSNorm(weight.shape[0], dtype=dtype)
    norm.weight.data.copy_(weight)
    return norm


SPOILS = {
    "one-row residual": lambda normed, residual: (normed, residual[:1]),
    "float32 output": lambda normed, residual: (normed.float(), residual),
}


@pytest.mark.parametrize("how", list(SPOILS))
def test_a_wrong_add_norm_return_fails_the_suite_with_the_runs_message(fresh_registry, inline_plugin, how):
    inline_plugin(AddNormPlugin(SPOILS[how]), name="acme")
    norm = RMSNorm(H, dtype=torch.float64)
    with pytest.raises(FusionError) as at_run_time:
        norm.fused_add_forward(torch.ones(ROWS, H, dtype=torch.float64), torch.ones(ROWS, H, dtype=torch.float64))
    with pytest.raises(ContractViolation) as in_the_suite:
        check_add_norm_kernel("acme.add_rmsnorm", settings=ContractSettings(dtypes=("float64",), rows=(ROWS,)))
    assert "LAYER_BOUNDARY_DISABLE_PLUGINS=acme" in str(at_run_time.value)
    assert f"T={ROWS}: {at_run_time.value}" in str(in_the_suite.value)


class Provider:
    def __init__(self, spoil):
        self.spoil = spoil

    def attention_input(self, stage):
        norm = stage.norm

        def run(owed, residual, fwd):
            return self.spoil(*add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual))

        return (FusedMlpInput(run=run, name="acme.fused_ar_norm"),)

    ffn_input = attention_input

    @hookimpl
    def layer_boundary_fusion_providers(self):
        yield FusionProvider(name="acme.ar_add_rmsnorm", factory=lambda stage: self, priority=10, description="test")


def _ffn_input(parallel):
    attn, ffn = make_stages((declare_attn(), RMSNorm(H, dtype=torch.float64)), (declare_ffn(), RMSNorm(H, dtype=torch.float64)),
                            terminal=True, parallel=parallel)
    fwd = Forward(parallel, ROWS)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.randn(ROWS, H, dtype=torch.float64), fwd), fwd)
    return ffn.prepare(h, fwd)


@pytest.mark.parametrize("how", list(SPOILS))
def test_a_wrong_fusion_return_fails_the_suite_with_the_runs_message(fresh_registry, inline_plugin, how):
    inline_plugin(Provider(SPOILS[how]), name="acme")
    with pytest.raises(FusionError) as at_run_time:
        run_threaded(_ffn_input, Topology(tp=2))
    settings = ContractSettings(topologies=(Topology(tp=2),), dtypes=("float64",), rows=(ROWS,), hidden_size=H)
    with pytest.raises(ContractViolation) as in_the_suite:
        check_fusion_provider("acme.ar_add_rmsnorm", checks=("parity",), settings=settings)
    assert str(at_run_time.value).endswith("set LAYER_BOUNDARY_DISABLE_PLUGINS=acme to run without it")
    assert f"[parity] {at_run_time.value} (" in str(in_the_suite.value)


def test_a_vendors_suite_runs_the_gpu_marked_cases_without_an_unknown_mark(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["layer_boundary.testing.pytest_plugin"]\n')
    (tmp_path / "test_vendor.py").write_text(textwrap.dedent("""
        import pytest
        from layer_boundary.plugin import FusionProvider
        from layer_boundary.testing.contract import contract_params

        RECORD = FusionProvider(name="acme.none", factory=lambda stage: None, priority=10, description="declines")

        @pytest.mark.parametrize("case", [p for p in contract_params(RECORD) if p.id.endswith("[cuda]")])
        def test_contract_on_cuda(case):
            assert case.device == "cuda"  # collected and marked like the suite's own cases

        @pytest.mark.gpu
        def test_marked():
            pass
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--strict-markers",
                          "-W", "error::pytest.PytestUnknownMarkWarning", "-m", "gpu", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "PytestUnknownMarkWarning" not in out.stdout + out.stderr
    # `-m gpu` selects the marked test and the contract's four per-device rules on CUDA (which skip without one)
    expected = "5 passed" if torch.cuda.is_available() else "1 passed, 4 skipped"
    assert expected in out.stdout, out.stdout[-2000:]
