"""The plugins' fused kernel calls as custom ops (CPU): their fake implementations under
FakeTensorMode, and a TP=2 boundary stack whose chosen flashinfer candidate is one graph node
per fused boundary under `torch.compile(fullgraph=True)`, equal to eager (the candidates bound to
the plugin's reference launchers, as its contract preparation binds them)."""

import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from layer_boundary import Forward, Parallel, Topology, boundaries_of
from layer_boundary.compiling import CountingBackend, graph_breaks
from layer_boundary.plugin import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))  # the core's compile test stack
from test_compile_core import MirrorCollectives, TP2Stack  # noqa: E402

pytest.importorskip("layer_boundary_flashinfer")
pytest.importorskip("layer_boundary_cutedsl")

from layer_boundary_cutedsl import graph_ops as cute_ops  # noqa: E402
from layer_boundary_flashinfer import graph_ops as fi_ops  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_the_fake_implementations_give_the_kernels_output_shapes():
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        rows, weights = torch.empty(5, 4, 64, dtype=torch.bfloat16), torch.empty(5, 4, dtype=torch.float32)
        gamma = torch.empty(64, dtype=torch.bfloat16)
        normed, residual = fi_ops.ALL_REDUCE_ADD_RMSNORM(x, x, "key")
        assert normed.shape == residual.shape == (5, 64) and normed.dtype == torch.bfloat16
        for per_token, scale_shape in ((True, (5, 1)), (False, ())):
            data, scale, residual = fi_ops.ALL_REDUCE_ADD_RMSNORM_FP8(x, x, "key", per_token)
            assert data.dtype == FP8_DTYPE and data.shape == (5, 64) and scale.shape == scale_shape and scale.dtype == torch.float32
        for shared in (None, x):
            normed, residual = fi_ops.FINALIZE_ALL_REDUCE_ADD_RMSNORM(rows, rows[:, :, 0], shared, x, "key")
            assert normed.shape == residual.shape == (5, 64)
            normed, residual = cute_ops.ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM(rows, weights, shared, x, gamma, 1e-6, 0.0, "key")
            assert normed.shape == residual.shape == (5, 64) and residual.dtype == torch.bfloat16
            assert cute_ops.MOE_FINALIZE(rows, weights, shared).shape == (5, 64)
            normed, residual = cute_ops.MOE_FINALIZE_ADD_RMSNORM(rows, weights, shared, x, gamma, 1e-6, 1.0)
            assert normed.shape == residual.shape == (5, 64)
        normed, residual = cute_ops.ONESHOT_ALL_REDUCE_ADD_RMSNORM(x, x, gamma, 1e-6, 0.0, "key")
        assert normed.shape == residual.shape == (5, 64)


def test_the_ops_run_on_meta_tensors_without_a_launch():
    x = torch.empty(3, 32, dtype=torch.float16, device="meta")
    normed, residual = fi_ops.ALL_REDUCE_ADD_RMSNORM(x, x, "no.such.key")  # the fake: nothing is looked up
    assert normed.device.type == "meta" and residual.shape == (3, 32)


def _flashinfer_stack(prep):
    from layer_boundary_flashinfer.provider import FlashInferFusion

    parallel = Parallel.create(Topology(tp=2), 0, MirrorCollectives)
    torch.manual_seed(0)
    stack = TP2Stack(parallel).to(torch.bfloat16).eval()
    bound = 0
    for boundary in boundaries_of(stack):
        for provider, _ in boundary.plan.providers:
            if isinstance(provider, FlashInferFusion):
                prep.bind(provider, boundary.plan)
                bound += provider.all_reduce.bound
    return parallel, stack, bound


@pytest.mark.parametrize("backend_name", ["eager", "aot_eager"])
@torch.inference_mode()
def test_a_chosen_flashinfer_candidate_is_one_graph_node_per_fused_boundary(backend_name):
    from layer_boundary_flashinfer.testing import ContractPreparation

    prep = ContractPreparation()
    with prep:
        parallel, stack, bound = _flashinfer_stack(prep)
        x = torch.randn(4, 32, dtype=torch.bfloat16)
        backend = CountingBackend(backend_name)
        out = torch.compile(stack, backend=backend, fullgraph=True)(x, Forward(parallel, 4))
        launches = len(prep._backend.launches)
        eager = stack(x, Forward(parallel, 4))
    eager_launches = len(prep._backend.launches) - launches
    assert bound == 3 and eager_launches == launches == 3  # every owed input fused, compiled as eagerly
    assert torch.equal(out, eager)
    assert backend.graphs == 1 and graph_breaks() == 0
    assert backend.count(fi_ops.ALL_REDUCE_ADD_RMSNORM) == 3
