"""What the torch-facing wrappers check before they launch (no GPU, no cutlass needed)."""

import pytest
import torch

from layer_boundary_cutedsl.kernels import fused_add_rmsnorm, moe_finalize, moe_finalize_add_rmsnorm
from layer_boundary_cutedsl.kernels.tiling import (
    AUTO,
    ROWS_BANDS,
    AddNormVariant,
    MoeVariant,
    default_grid,
    group_tiling,
    parse_candidate,
    row_tiling,
    rows_kernel,
)

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


def test_multi_row_layouts():
    # rows side by side in a CTA: threads per row (a multiple of 32) and rows per CTA
    t = group_tiling(4096, bf16, 64, 2)
    assert (t.threads, t.vpt, t.rows_per_cta, t.cta_threads, t.warps, t.full) == (64, 8, 2, 128, 2, True)
    t = group_tiling(2880, bf16, 128, 1)
    assert (t.vpt, t.full) == (3, False) and t.threads * t.vpt * t.vec >= 2880
    assert row_tiling(4096).rows_per_cta == 1 and row_tiling(4096).cta_threads == 128
    for threads, rows in ((48, 2), (0, 1), (64, 0), (512, 4)):
        with pytest.raises(ValueError, match="multiple of 32"):
            group_tiling(4096, bf16, threads, rows)
    with pytest.raises(ValueError, match="idle"):
        group_tiling(2048, bf16, 256 + 32, 1)  # 256 vectors on 288 threads: a warp with nothing to do
    # a CTA per rows_per_cta rows, the last one partly empty
    assert [default_grid(n, 4) for n in (0, 1, 4, 5, 301)] == [0, 1, 1, 2, 76]
    assert default_grid(301) == 301
    # an explicit layout is part of the kernel's name (and so of its compile cache key)
    assert AddNormVariant(bf16, 4096, layout=(64, 2)).name == "add_rmsnorm_bf16_h4096_r64x2"
    assert AddNormVariant(bf16, 4096, layout=(64, 2)).tiling() == group_tiling(4096, bf16, 64, 2)
    assert AddNormVariant(bf16, 4096, staged=True).name == "add_rmsnorm_bf16_h4096_staged"
    with pytest.raises(ValueError, match="shared memory"):  # two staged 32 KiB rows: over 48 KiB
        AddNormVariant(bf16, 16384, staged=True)
    # re-reading the row needs it staged; the occupancy request is part of the name
    assert AddNormVariant(bf16, 4096, staged=True, reread=True, ctas_per_sm=8).name == "add_rmsnorm_bf16_h4096_reread_o8"
    with pytest.raises(ValueError, match="needs staged=True"):
        AddNormVariant(bf16, 4096, reread=True)
    with pytest.raises(ValueError, match="0..32"):
        AddNormVariant(bf16, 4096, ctas_per_sm=33)
    # FlashInfer's way of reading gamma and of caching the staged copies: named, and L1 staging
    # only where something is staged
    assert AddNormVariant(bf16, 4096, layout=(64, 2), staged=True, l1_staging=True, late_trigger=True, late_gamma=True).name == (
        "add_rmsnorm_bf16_h4096_late_r64x2_staged_l1_lategamma")
    with pytest.raises(ValueError, match="needs staged=True"):
        AddNormVariant(bf16, 4096, l1_staging=True)
    assert AddNormVariant(bf16, 4096, no_loop=True).name == "add_rmsnorm_bf16_h4096_noloop"


def test_a_plain_calls_kernel_by_token_count(monkeypatch):
    """A plain call's kernel comes from the ROWS_BANDS table: its bands ordered and disjoint, each
    kernel buildable at its width; outside them (and at widths not listed) the default tiling."""
    from layer_boundary_cutedsl.kernels import add_rmsnorm, tiling

    def check(bands):
        for hidden, rows in bands.items():
            end_before = 1
            for first, end, name in rows:
                assert end_before <= first < end, (hidden, rows)
                end_before = end
                AddNormVariant(torch.bfloat16, hidden, **parse_candidate(name))

    check(ROWS_BANDS)  # the shipped table
    assert ROWS_BANDS, "the shipped table names a kernel per width's middle band"
    table = {4096: ((384, 768, "128x2+s+l1+late+g"), (768, 2048, "64x2+s+l1+late+g"))}
    check(table)
    monkeypatch.setattr(tiling, "ROWS_BANDS", table)
    assert rows_kernel(4096, 1024) == "64x2+s+l1+late+g" and rows_kernel(4096, 384) == "128x2+s+l1+late+g"
    assert rows_kernel(4096, 383) == rows_kernel(4096, 2048) == rows_kernel(2880, 1024) == "default"
    parsed = add_rmsnorm.parse_bands(table)[4096]
    assert parsed[1][:2] == (768, 2048) and dict(zip(add_rmsnorm.KERNEL_OPTIONS, parsed[1][2])) == dict(
        pdl=True, layout=(64, 2), staged=True, late_trigger=True, reread=False, ctas_per_sm=0, late_gamma=True, l1_staging=True,
        no_loop=False)
    assert parse_candidate("auto") == dict(layout=AUTO)
    with pytest.raises(ValueError, match="layout is None or"):
        AddNormVariant(torch.bfloat16, 4096, layout=AUTO)
