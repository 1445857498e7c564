"""The flashinfer plugin's fused all-reduce + add + RMSNorm on GPU ranks (groups `flashinfer`,
2 ranks, and `flashinfer4`, 4 ranks, of scripts/gpu_tests.sh). The ranks are processes of the
core's `gpu_world` fixture: one GPU each over NCCL, or sharing the GPUs over gloo (correctness
only). Each test runs one check of `flashinfer_fusion_checks` (its docstring says what each
compares) on every rank and fails on any rank's failed check; rank 0's checks are printed with
their facts. A cold machine JIT-builds FlashInfer's trtllm_comm module at the first prepare
(about 5 minutes; scripts/gpu_tests.sh restores a cached build)."""

import importlib.util

import pytest
import torch

from flashinfer_fusion_checks import (
    Case, check_boundary, check_defects, check_finalize, check_fallback, check_fp8_reads, check_graph_decode, check_memory,
    check_model, check_twoshot, failures,
)
from layer_boundary import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it when there are fewer GPUs)"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
    pytest.mark.timeout(480),
]

#: one call's limit: the first prepare of a cold machine builds FlashInfer's trtllm_comm module
CALL_TIMEOUT = 420
TP2 = pytest.param(2, id="tp2")
TP4 = pytest.param(4, id="tp4")


def _passes(gpu_world, ranks, check, *args, **kwargs):
    per_rank = gpu_world(ranks, timeout=CALL_TIMEOUT).run(check, Topology(tp=ranks), Case(), *args, timeout=CALL_TIMEOUT, **kwargs)
    failed = failures(per_rank)
    assert not failed, failed
    assert all(per_rank), "a rank ran no check"
    return per_rank[0]


def test_memory(gpu_world):
    """Runs first: no workspace exists before it."""
    assert len(_passes(gpu_world, 2, check_memory)) == 2


@pytest.mark.parametrize("ranks", [TP2, TP4])
def test_boundary(gpu_world, ranks):
    checks = _passes(gpu_world, ranks, check_boundary)
    assert any("eager fast path" in c["check"] for c in checks) and sum("CUDA-graph replay" in c["check"] for c in checks) == 2


@pytest.mark.parametrize("ranks", [TP2])
def test_twoshot(gpu_world, ranks):
    assert len(_passes(gpu_world, ranks, check_twoshot)) > 6


@pytest.mark.parametrize("ranks", [TP2, TP4])
def test_finalize(gpu_world, ranks):
    assert len(_passes(gpu_world, ranks, check_finalize)) == 12


@pytest.mark.parametrize("ranks", [TP2])
def test_fallback(gpu_world, ranks):
    assert len(_passes(gpu_world, ranks, check_fallback)) == 5


@pytest.mark.parametrize("ranks", [TP2])
def test_flashinfer_defects_the_plugin_declines(gpu_world, ranks):
    assert len(_passes(gpu_world, ranks, check_defects)) == 6


@pytest.mark.parametrize("ranks", [TP2])
def test_fp8_reads(gpu_world, ranks):
    assert len(_passes(gpu_world, ranks, check_fp8_reads)) == 20


@pytest.mark.parametrize("ranks, name", [(2, "qwen3"), (2, "gemma"), (2, "qwen3_moe"), (4, "qwen3"), (4, "qwen3_moe")],
                         ids=["tp2-qwen3", "tp2-gemma", "tp2-qwen3_moe", "tp4-qwen3", "tp4-qwen3_moe"])
def test_model_logits_with_the_plugin_on_and_off(gpu_world, ranks, name):
    _passes(gpu_world, ranks, check_model, name)


@pytest.mark.parametrize("ranks, name", [(2, "qwen3"), (2, "qwen3_moe")], ids=["tp2-qwen3", "tp2-qwen3_moe"])
def test_every_fused_call_of_a_model_within_one_bf16_rounding(gpu_world, ranks, name):
    _passes(gpu_world, ranks, check_model, name, shadow=True)


@pytest.mark.parametrize("ranks, name", [(2, "qwen3"), (2, "qwen3_moe"), (4, "qwen3")], ids=["tp2-qwen3", "tp2-qwen3_moe", "tp4-qwen3"])
def test_graph_decode_replays_eager(gpu_world, ranks, name):
    assert len(_passes(gpu_world, ranks, check_graph_decode, name)) == 2
