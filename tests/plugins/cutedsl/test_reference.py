"""The float64 references against hand-computed cases and the core's unfused semantics."""

import pytest
import torch

from layer_boundary import MoeFinalizeHandoff
from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary_cutedsl.kernels import (
    add_rmsnorm_reference,
    dense_indices,
    handoff_args,
    moe_finalize_add_rmsnorm_reference,
    moe_finalize_reference,
)

f64 = torch.float64


def test_add_rmsnorm_hand_computed():
    x = torch.tensor([[1.0, 3.0], [0.5, -0.5]], dtype=f64)
    r = torch.tensor([[1.0, -1.0], [1.5, 2.5]], dtype=f64)
    gamma = torch.tensor([1.0, 2.0], dtype=f64)
    normed, total = add_rmsnorm_reference(x, r, gamma, 0.0)
    # row 0: sum [2, 2], mean square 4, rstd 1/2 -> [1, 1] * gamma
    # row 1: sum [2, 2] as well
    assert torch.equal(total, torch.tensor([[2.0, 2.0], [2.0, 2.0]], dtype=f64))
    assert torch.allclose(normed, torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=f64))
    # eps enters under the root: mean square 4 + eps 5 -> rstd 1/3
    normed, _ = add_rmsnorm_reference(x, r, gamma, 5.0)
    assert torch.allclose(normed, torch.tensor([[2 / 3, 4 / 3], [2 / 3, 4 / 3]], dtype=f64))


def test_gemma_offset_is_one_plus_w():
    x = torch.tensor([[3.0, -4.0]], dtype=f64)
    r = torch.zeros(1, 2, dtype=f64)
    w = torch.tensor([0.0, 1.0], dtype=f64)
    normed, _ = add_rmsnorm_reference(x, r, w, 0.0, weight_offset=1.0)
    # mean square 12.5 -> x / sqrt(12.5) * (1 + w)
    s = 12.5**0.5
    assert torch.allclose(normed, torch.tensor([[3 / s * 1.0, -4 / s * 2.0]], dtype=f64))


def test_rounds_once_to_the_input_dtype():
    x = torch.tensor([[1.0, 2.0**-9]], dtype=torch.bfloat16)
    r = torch.tensor([[2.0**-9, 1.0]], dtype=torch.bfloat16)
    normed, total = add_rmsnorm_reference(x, r, torch.ones(2, dtype=torch.bfloat16), 1e-6)
    assert normed.dtype == total.dtype == torch.bfloat16
    # 1 + 2^-9 is not a bf16: the new residual is the sum rounded once (to 1.0)
    assert torch.equal(total, torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16))
    exact_normed, exact_total = add_rmsnorm_reference(x, r, torch.ones(2, dtype=torch.bfloat16), 1e-6, exact=True)
    assert exact_total.dtype == f64 and exact_total[0, 0] == 1.0 + 2.0**-9


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_matches_core_add_rms_norm(norm_cls):
    gen = torch.Generator().manual_seed(0)
    hidden = 64
    norm = norm_cls(hidden, 1e-5, dtype=f64, compute_dtype=f64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen, dtype=f64) * 0.1)
    x = torch.randn(5, hidden, generator=gen, dtype=f64)
    r = torch.randn(5, hidden, generator=gen, dtype=f64)
    want_normed, want_res = norm.add_forward(x, r)
    # the multiplier as applied, offset 0 ...
    got_normed, got_res = add_rmsnorm_reference(x, r, norm.gemma_weight.detach(), norm.eps)
    assert torch.allclose(got_normed, want_normed, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_res, want_res)
    # ... or the raw weight with the norm's own offset
    got_normed, _ = add_rmsnorm_reference(x, r, norm.weight.detach(), norm.eps, weight_offset=norm.offset)
    assert torch.allclose(got_normed, want_normed, rtol=1e-12, atol=1e-12)


ROUTED = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [3.0, -1.0]], dtype=f64)


def test_moe_index_convention_hand_computed():
    indices = torch.tensor([[2, 0], [-1, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 2.0], [9.0, 1.0]], dtype=torch.float32)
    got = moe_finalize_reference(ROUTED, indices, weights)
    # t0: 0.5 * row 2 + 2 * row 0; t1: slot 0 skipped (its weight ignored) + 1 * row 3
    assert torch.equal(got, torch.tensor([[3.0, 1.0], [3.0, -1.0]], dtype=f64))
    shared = torch.tensor([[1.0, 1.0], [0.0, 0.5]], dtype=f64)
    got = moe_finalize_reference(ROUTED, indices, weights, shared)
    assert torch.equal(got, torch.tensor([[4.0, 2.0], [3.0, -0.5]], dtype=f64))


def test_moe_dense_layout_is_t_times_top_k_plus_k():
    weights = torch.tensor([[0.5, 2.0], [9.0, 1.0]], dtype=torch.float32)
    got = moe_finalize_reference(ROUTED, None, weights)
    # t0: 0.5 * row 0 + 2 * row 1; t1: 9 * row 2 + 1 * row 3
    assert torch.equal(got, torch.tensor([[0.5, 2.0], [21.0, 17.0]], dtype=f64))
    assert torch.equal(dense_indices(2, 2), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    assert torch.equal(got, moe_finalize_reference(ROUTED, dense_indices(2, 2), weights))
    # a [T, top_k, H] tensor is the same dense layout
    assert torch.equal(got, moe_finalize_reference(ROUTED.view(2, 2, 2), None, weights))


def test_moe_add_rmsnorm_is_finalize_then_add_norm():
    indices = torch.tensor([[2, 0], [-1, 3]], dtype=torch.int64)
    weights = torch.tensor([[0.5, 2.0], [9.0, 1.0]], dtype=torch.float32)
    residual = torch.tensor([[-3.0, 1.0], [1.0, 3.0]], dtype=f64)
    gamma = torch.tensor([1.0, 0.5], dtype=f64)
    normed, total = moe_finalize_add_rmsnorm_reference(ROUTED, indices, weights, None, residual, gamma, 0.0)
    # totals [0, 2] and [4, 2]: rstd 1/sqrt(2) and 1/sqrt(10)
    assert torch.equal(total, torch.tensor([[0.0, 2.0], [4.0, 2.0]], dtype=f64))
    want = torch.tensor([[0.0, 2 / 2**0.5 * 0.5], [4 / 10**0.5, 2 / 10**0.5 * 0.5]], dtype=f64)
    assert torch.allclose(normed, want)


def test_zero_tokens():
    h = 16
    empty = torch.empty(0, h, dtype=torch.bfloat16)
    normed, total = add_rmsnorm_reference(empty, empty, torch.ones(h, dtype=torch.bfloat16), 1e-6)
    assert normed.shape == total.shape == (0, h)
    w = torch.empty(0, 4, dtype=torch.float32)
    assert moe_finalize_reference(torch.empty(0, h, dtype=torch.bfloat16), None, w).shape == (0, h)
    normed, total = moe_finalize_add_rmsnorm_reference(
        torch.empty(0, h, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.int32), w, None, empty, torch.ones(h), 1e-6
    )
    assert normed.shape == total.shape == (0, h)


def test_core_handoff_is_the_dense_layout():
    gen = torch.Generator().manual_seed(1)
    t, k, h = 3, 2, 8
    rows = torch.randn(t, k, h, generator=gen, dtype=f64)
    weights = torch.rand(t, k, generator=gen, dtype=f64)
    handoff = MoeFinalizeHandoff(rows, weights, torch.zeros(t, k, dtype=torch.int64), None, None, None)
    routed, indices, w, shared = handoff_args(handoff)
    assert indices is None and shared is None
    got = moe_finalize_reference(routed, indices, w, shared)
    assert torch.allclose(got, handoff.finalize_local(), rtol=1e-12, atol=1e-12)
