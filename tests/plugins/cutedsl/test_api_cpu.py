"""What the torch-facing wrappers check before they launch (no GPU, no cutlass needed)."""

import pytest
import torch

from layer_boundary_cutedsl.kernels import fused_add_rmsnorm, moe_finalize, moe_finalize_add_rmsnorm
from layer_boundary_cutedsl.kernels.tiling import MoeVariant, row_tiling

bf16 = torch.bfloat16


def test_zero_tokens_launch_nothing_and_return_empty_outputs():
    h = 4096
    x = torch.empty(0, h, dtype=bf16)
    normed, res = fused_add_rmsnorm(x, torch.empty(0, h, dtype=bf16), torch.ones(h, dtype=bf16), 1e-6)
    assert normed.shape == res.shape == (0, h)
    normed, res = moe_finalize_add_rmsnorm(
        torch.empty(0, 8, h, dtype=bf16), None, torch.empty(0, 8), torch.empty(0, h, dtype=bf16), torch.ones(h, dtype=bf16), 1e-6
    )
    assert normed.shape == res.shape == (0, h)
    assert moe_finalize(torch.empty(0, h, dtype=bf16), torch.empty(0, 8, dtype=torch.int32), torch.empty(0, 8)).shape == (0, h)


@pytest.mark.parametrize("hidden", [100, 20000])
def test_unsupported_hidden_sizes_are_refused(hidden):
    x = torch.empty(2, hidden, dtype=bf16)
    with pytest.raises(ValueError, match="multiple of 8"):
        fused_add_rmsnorm(x, x.clone(), torch.ones(hidden, dtype=bf16), 1e-6)


def test_fp32_rows_are_refused():
    x = torch.empty(2, 64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fused_add_rmsnorm(x, x.clone(), torch.ones(64), 1e-6)


def test_non_contiguous_rows_and_mismatched_shapes_are_refused():
    h = 64
    x = torch.empty(3, 2 * h, dtype=bf16)[:, :h]
    with pytest.raises(ValueError, match="row-major"):
        fused_add_rmsnorm(x, torch.empty(3, h, dtype=bf16), torch.ones(h, dtype=bf16), 1e-6)
    with pytest.raises(ValueError, match="shape"):
        fused_add_rmsnorm(torch.empty(3, h, dtype=bf16), torch.empty(2, h, dtype=bf16), torch.ones(h, dtype=bf16), 1e-6)
    with pytest.raises(TypeError, match="float16"):
        fused_add_rmsnorm(torch.empty(3, h, dtype=bf16), torch.empty(3, h, dtype=torch.float16), torch.ones(h, dtype=bf16), 1e-6)


def test_moe_routing_shapes_are_checked():
    h = 64
    with pytest.raises(ValueError, match="must match weights"):
        moe_finalize(torch.empty(8, h, dtype=bf16), torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, 4))
    with pytest.raises(ValueError, match="dense routed rows"):
        moe_finalize(torch.empty(7, h, dtype=bf16), None, torch.ones(2, 4))
    with pytest.raises(ValueError, match="top_k"):
        moe_finalize(torch.empty(40, h, dtype=bf16), None, torch.ones(2, 20))


def test_tiling_choices():
    # a whole row in registers with 16-byte vectors; at least 128 threads, at most 4 vectors each
    assert (row_tiling(1024).threads, row_tiling(1024).vpt) == (128, 1)
    assert (row_tiling(4096).threads, row_tiling(4096).vpt) == (128, 4)
    assert (row_tiling(8192).threads, row_tiling(8192).vpt) == (256, 4)
    assert (row_tiling(7168).threads, row_tiling(7168).vpt, row_tiling(7168).full) == (224, 4, True)
    t = row_tiling(2880)
    assert t.threads * t.vpt * t.vec >= 2880 and not t.full
    assert row_tiling(4096, torch.float16).vec == 8
    # the MoE kernel keeps top_k rows in flight: at most 2 vectors per thread
    assert MoeVariant(bf16, 8192, 8).tiling().vpt == 2
    with pytest.raises(ValueError):
        MoeVariant(bf16, 4096, 0)
