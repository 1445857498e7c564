"""`torch.library.opcheck` on the plugins' fused kernel ops where they can run (group
`compile-ops` of scripts/gpu_tests.sh): the CuTe DSL MoE ops on one rank; on 2 ranks of the
shared-device world (both on one GPU when it is the only one), each rank checking the op of its
own bound candidate or workspace in lock-step with the other: FlashInfer's fused all-reduce +
add + RMSNorm, the same ending in FP8 (per-token and fixed scale), and the CuTe DSL one-shot
all-reduce + add + RMSNorm and MoE finalize + all-reduce + add + RMSNorm. Each op's result is
also held equal to the eager launch it stands for.

FlashInfer's `finalize_all_reduce_add_rmsnorm` has no case: its candidate never binds on CUDA
(FlashInfer 0.7.2's finalize kernel reads its peers' buffers before they are written, so the
plugin declines it; the MoE's sum takes the plain fused all-reduce), and its fake is checked on
the CPU (tests/plugins/test_fused_ops_compile.py)."""

import importlib.util

import pytest
import torch

from layer_boundary import Topology, boundaries_of
from layer_boundary_models import build_model, family, model_config
from layer_boundary.plugin import StateDictSource

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


def _fp8_opcheck_rank(parallel):
    """On this rank: an FP8-quantizing read's fused candidate (per-token and fixed scale), its
    op against its launch, then opcheck."""
    from layer_boundary.plugin import graph_key
    from layer_boundary_flashinfer import graph_ops
    from layer_boundary_flashinfer.bench import BoundaryPair
    from layer_boundary_flashinfer.provider import FlashInferFusion
    from layer_boundary_flashinfer.service import prepare_flashinfer_fusion, shutdown_flashinfer_fusion

    device = f"cuda:{torch.cuda.current_device()}"
    out = []
    try:
        for fmt, scale in (("fp8_dynamic", None), ("fp8_static", 8.0 / 448.0)):
            pair = BoundaryPair(parallel, 2048, torch.bfloat16, device, fp8=(fmt, scale))
            prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=64)
            candidate = next(
                p.fp8 for b in pair.boundaries for p, _ in b.plan.providers if isinstance(p, FlashInferFusion) and p.fp8.bound
            )
            torch.manual_seed(1 + parallel.rank)
            x = torch.randn(5, 2048, dtype=torch.bfloat16, device=device)
            residual = torch.randn_like(x)
            quant, eager_residual = candidate.launch(x, residual, 5)
            eager = (quant.data.view(torch.uint8).clone(), quant.scale.float().reshape(-1).clone(), eager_residual.clone())
            key = graph_key(candidate)
            data, got_scale, new_residual = graph_ops.ALL_REDUCE_ADD_RMSNORM_FP8(x, residual, key, candidate.per_token)
            same = (torch.equal(data.view(torch.uint8), eager[0]) and torch.equal(got_scale.float().reshape(-1), eager[1])
                    and torch.equal(new_residual, eager[2]))
            torch.library.opcheck(graph_ops.ALL_REDUCE_ADD_RMSNORM_FP8, (x, residual, key, candidate.per_token), test_utils=TESTS)
            out.append({"format": fmt, "per_token": candidate.per_token, "op_equals_launch": bool(same)})
            shutdown_flashinfer_fusion()
        return {"rank": parallel.rank, "cases": out, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return {"rank": parallel.rank, "cases": out, "error": f"{type(exc).__name__}: {str(exc)[:1500]}"}
    finally:
        shutdown_flashinfer_fusion()


@pytest.mark.gpu
@needs_gpu
def test_opcheck_flashinfer_fp8_on_two_ranks(gpu_world):
    pytest.importorskip("layer_boundary_flashinfer")
    pytest.importorskip("flashinfer")
    results = gpu_world(2).run(_fp8_opcheck_rank, Topology(tp=2))
    print(f"\n{results}")
    for r in results:
        assert r["error"] is None, r
        assert [c["per_token"] for c in r["cases"]] == [True, False], r  # both quantizations ran
        assert all(c["op_equals_launch"] for c in r["cases"]), r


def _oneshot_opcheck_rank(parallel):
    """On this rank: a CuTe DSL one-shot workspace of the TP group; its two fused ops against
    the workspace's launches, then opcheck (every call a collective: both ranks run the same)."""
    from layer_boundary.plugin import graph_key
    from layer_boundary_cutedsl import graph_ops
    from cutedsl.allreduce_checks import _group, _held, _workspace, use_rank_device  # tests/plugins/cutedsl

    device = use_rank_device(parallel)
    group = _group(parallel)
    hidden, tokens, top_k, eps = 2048, 5, 4, 1e-6
    same = {}
    try:
        with _held(_workspace(group, device, torch.bfloat16, hidden, 16, offsets=(0.0,), moe_shapes=[(top_k, True)])) as ws:
            key = graph_key(ws)
            mine = torch.Generator(device=device).manual_seed(1 + group.rank)
            common = torch.Generator(device=device).manual_seed(99)  # what every rank holds alike
            partial = torch.randn(tokens, hidden, generator=mine, device=device).to(torch.bfloat16)
            residual = torch.randn(tokens, hidden, generator=common, device=device).to(torch.bfloat16)
            gamma = torch.rand(hidden, generator=common, device=device).to(torch.bfloat16)
            eager = [t.clone() for t in ws.all_reduce_add_rmsnorm(partial, residual, gamma, eps, 0.0)]
            got = graph_ops.ONESHOT_ALL_REDUCE_ADD_RMSNORM(partial, residual, gamma, eps, 0.0, key)
            same["all_reduce_add_rmsnorm"] = all(torch.equal(g, e) for g, e in zip(got, eager))
            torch.library.opcheck(graph_ops.ONESHOT_ALL_REDUCE_ADD_RMSNORM, (partial, residual, gamma, eps, 0.0, key), test_utils=TESTS)
            rows = torch.randn(tokens, top_k, hidden, generator=mine, device=device).to(torch.bfloat16)
            weights = torch.rand(tokens, top_k, generator=common, device=device)
            shared = torch.randn(tokens, hidden, generator=mine, device=device).to(torch.bfloat16)
            args = (rows, weights, shared, residual, gamma, eps, 0.0)
            eager = [t.clone() for t in ws.moe_finalize_all_reduce_add_rmsnorm(*args)]
            got = graph_ops.ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM(*args, key)
            same["moe_finalize_all_reduce_add_rmsnorm"] = all(torch.equal(g, e) for g, e in zip(got, eager))
            torch.library.opcheck(graph_ops.ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM, (*args, key), test_utils=TESTS)
        return {"rank": parallel.rank, "op_equals_launch": same, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return {"rank": parallel.rank, "op_equals_launch": same, "error": f"{type(exc).__name__}: {str(exc)[:1500]}"}


@pytest.mark.gpu
@needs_gpu
@needs_cutlass
def test_opcheck_cutedsl_oneshot_ops_on_two_ranks(gpu_world):
    results = gpu_world(2).run(_oneshot_opcheck_rank, Topology(tp=2), timeout=300)
    print(f"\n{results}")
    for r in results:
        assert r["error"] is None, r
        assert len(r["op_equals_launch"]) == 2 and all(r["op_equals_launch"].values()), r
