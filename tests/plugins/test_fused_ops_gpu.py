"""`torch.library.opcheck` on the plugins' fused kernel ops where they can run (group
`compile-ops` of scripts/gpu_tests.sh): the CuTe DSL MoE ops on one rank, FlashInfer's fused
all-reduce + add + RMSNorm on 2 ranks of the shared-device world (both on one GPU when it is the
only one), each rank checking the op of its own bound candidate in lock-step with the other."""

import importlib.util

import pytest
import torch

from layer_boundary import Topology, boundaries_of
from layer_boundary.models import build_model, family, model_config
from layer_boundary.models.weights import StateDictSource

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_cutlass = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")

#: opcheck's tests that apply to an op without autograd: the schema, fake tensors, AOT dispatch
TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.gpu
@needs_gpu
@needs_cutlass
@pytest.mark.parametrize("shared", [False, True])
def test_opcheck_cutedsl_moe_ops(shared):
    from layer_boundary_cutedsl import graph_ops

    torch.manual_seed(0)
    rows = torch.randn(6, 4, 2048, dtype=torch.bfloat16, device="cuda")
    weights = torch.rand(6, 4, dtype=torch.float32, device="cuda")
    extra = torch.randn(6, 2048, dtype=torch.bfloat16, device="cuda") if shared else None
    residual = torch.randn(6, 2048, dtype=torch.bfloat16, device="cuda")
    gamma = torch.rand(2048, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(graph_ops.MOE_FINALIZE, (rows, weights, extra), test_utils=TESTS)
    torch.library.opcheck(graph_ops.MOE_FINALIZE_ADD_RMSNORM, (rows, weights, extra, residual, gamma, 1e-6, 0.0), test_utils=TESTS)
    from layer_boundary_cutedsl import local_add_norm  # registers layer_boundary_cutedsl::local_add_rmsnorm

    torch.library.opcheck(local_add_norm._local_add_rmsnorm, (rows[:, 0], residual, gamma, 1e-6, 1.0), test_utils=TESTS)


def _flashinfer_opcheck_rank(parallel):
    """On this rank: a TP=2 qwen3 prepared with the flashinfer plugin, then opcheck on the op of
    its first bound all-reduce + add + RMSNorm candidate (every rank runs the same calls)."""
    from layer_boundary._lifecycle import prepare_model, release_model
    from layer_boundary.plugin import graph_key
    from layer_boundary_flashinfer import graph_ops
    from layer_boundary_flashinfer.provider import FlashInferFusion

    device = f"cuda:{torch.cuda.current_device()}"
    config = model_config("qwen3")
    model = build_model(config, parallel, dtype=torch.bfloat16, device=device)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, torch.bfloat16, seed=5)))
    prepare_model(model, max_tokens=64)
    try:
        candidate = next(
            p.all_reduce for b in boundaries_of(model) for p, _ in b.plan.providers if isinstance(p, FlashInferFusion) and p.all_reduce.bound
        )
        torch.manual_seed(1 + parallel.rank)
        x = torch.randn(5, candidate.hidden, dtype=torch.bfloat16, device=device)
        residual = torch.randn_like(x)
        eager = candidate.launch(x, residual, 5)
        normed, new_residual = graph_ops.ALL_REDUCE_ADD_RMSNORM(x, residual, graph_key(candidate))
        same = bool(torch.equal(normed, eager[0]) and torch.equal(new_residual, eager[1]))
        torch.library.opcheck(graph_ops.ALL_REDUCE_ADD_RMSNORM, (x, residual, graph_key(candidate)), test_utils=TESTS)
        return {"rank": parallel.rank, "op_equals_launch": same, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return {"rank": parallel.rank, "op_equals_launch": False, "error": f"{type(exc).__name__}: {str(exc)[:1500]}"}
    finally:
        release_model(model)


@pytest.mark.gpu
@needs_gpu
def test_opcheck_flashinfer_all_reduce_add_rmsnorm_on_two_ranks(gpu_world):
    pytest.importorskip("layer_boundary_flashinfer")
    pytest.importorskip("flashinfer")
    results = gpu_world(2).run(_flashinfer_opcheck_rank, Topology(tp=2))
    print(f"\n{results}")
    for r in results:
        assert r["error"] is None and r["op_equals_launch"], r
