"""Every kernel variant compiles for sm_90a on this (CPU-only) machine.

CuTe DSL compiles without a GPU when the target is named (`--gpu-arch sm_90a`) and the host
entry takes scalars rather than device tensors: compiler.py does both. A variant that fails to
compile fails here, not on the GPU machine.
"""

import importlib.util

import pytest
import torch

from layer_boundary_cutedsl.kernels.gated_activation import GatedActivationVariant
from layer_boundary_cutedsl.kernels.qk_norm_rope import QKNormRopeVariant
from layer_boundary_cutedsl.kernels.tiling import (
    ROWS_BANDS,
    TESTED_TOP_K,
    AddNormVariant,
    MoeVariant,
    all_add_norm_variants,
    all_moe_variants,
    parse_candidate,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)"
)

ADD_NORM = list(all_add_norm_variants())
# dtype x hidden x (gathered | dense) x shared x (plain norm | Gemma norm | no norm), top_k 8
MOE = list(all_moe_variants())
# the other top_k values on two widths (one that needs bounds checks, one that does not)
MOE_TOP_K = [
    MoeVariant(torch.bfloat16, hidden, top_k, indexed, shared=True)
    for hidden in (2880, 4096)
    for top_k in TESTED_TOP_K
    if top_k != 8
    for indexed in (True, False)
]


def _compile(variant, ptx_dir):
    """Compile for sm_90a and lint the PTX for what would hang a launch (ptx_lint.py): a
    barrier or warp shuffle under thread-divergent code, a block size other than the launch's."""
    from layer_boundary_cutedsl.kernels.compiler import compile_variant
    from .ptx_lint import lint

    compiled = compile_variant(variant, "sm_90a", keep_ptx_dir=str(ptx_dir))
    assert compiled.has_gpu_module and len(compiled.kernel_info) == 1, variant
    assert lint(compiled.__ptx__, variant.tiling().cta_threads) == [], variant


@pytest.mark.parametrize("variant", ADD_NORM, ids=lambda v: v.name)
def test_add_rmsnorm_compiles(variant, tmp_path):
    _compile(variant, tmp_path)


#: multi-row CTA layouts (threads per row, rows per CTA), on a width with bounds checks and one without
LAYOUT_VARIANTS = [
    AddNormVariant(torch.bfloat16, hidden, offset, True, layout)
    for hidden in (2880, 4096)
    for layout in ((32, 4), (64, 2), (64, 4), (128, 1), (128, 2), (256, 1))
    for offset in (0.0,)
] + [AddNormVariant(torch.float16, 8192, 1.0, False, (128, 2))] + [
    AddNormVariant(torch.bfloat16, hidden, 0.0, True, layout, staged=True)
    for hidden in (2880, 4096)
    for layout in (None, (64, 2))
] + [AddNormVariant(torch.bfloat16, 4096, late_trigger=True), AddNormVariant(torch.bfloat16, 2880, layout=(256, 1), late_trigger=True)] + [
    AddNormVariant(torch.bfloat16, hidden, 0.0, True, layout, staged=True, reread=True)
    for hidden in (2880, 4096)
    for layout in (None, (64, 2), (128, 2))
] + [
    AddNormVariant(torch.float16, 2880, 1.0, True, staged=True, reread=True, ctas_per_sm=8),
    AddNormVariant(torch.bfloat16, 4096, 0.0, True, (128, 2), staged=True, reread=True, ctas_per_sm=4),
] + [  # gamma read late, staged copies through L1 (FlashInfer's loads), alone and together
    AddNormVariant(torch.bfloat16, 4096, 0.0, True, (64, 2), staged=True, l1_staging=True, late_trigger=True, late_gamma=True),
    AddNormVariant(torch.bfloat16, 2880, 1.0, True, late_gamma=True),
    AddNormVariant(torch.float16, 2048, 0.0, True, (32, 4), staged=True, l1_staging=True),
    AddNormVariant(torch.bfloat16, 4096, 1.0, True, staged=True, reread=True, late_gamma=True),
] + [  # every kernel a plain call picks by token count, and FlashInfer's form at each width, Gemma's too
    AddNormVariant(torch.bfloat16, hidden, offset, **parse_candidate(name))
    for hidden, name in sorted({(h, name) for h, bands in ROWS_BANDS.items() for _, _, name in bands} | {
        (2048, "128x1+s+l1+late+g"), (4096, "128x2+s+l1+late+g"), (7168, "128x1+s+l1+late+g"), (8192, "128x1+s+l1+late+g")})
    for offset in (0.0, 1.0)
] + [  # no grid-stride loop: one row or one block of rows a CTA
    AddNormVariant(torch.bfloat16, 4096, 0.0, no_loop=True),
    AddNormVariant(torch.float16, 2880, 1.0, no_loop=True),
    AddNormVariant(torch.bfloat16, 2048, 0.0, layout=(32, 4), no_loop=True),
    AddNormVariant(torch.bfloat16, 4096, 0.0, layout=(64, 2), staged=True, l1_staging=True, late_trigger=True, late_gamma=True, no_loop=True),
    AddNormVariant(torch.bfloat16, 4096, 1.0, staged=True, reread=True, no_loop=True),
]


@pytest.mark.parametrize("variant", LAYOUT_VARIANTS, ids=lambda v: v.name)
def test_add_rmsnorm_layouts_compile(variant, tmp_path):
    """The CTA holds rows_per_cta rows: the lint checks the launch's block (threads x rows) and
    that no barrier sits under the rows-past-the-end branch."""
    _compile(variant, tmp_path)


def test_ctas_per_sm_caps_the_registers():
    """The re-read kernel at H=4096 (four vectors a thread) takes more than 64 registers on its
    own (6 CTAs an SM); asked for 8 CTAs of 128 threads an SM, ptxas fits it in 64 (65536 /
    (8 * 128)), spilling a little. The default kernel holds 4: T=1024 takes two waves."""
    from .occupancy import add_norm_occupancy

    default = add_norm_occupancy("default", 4096)
    free = add_norm_occupancy("default+s+r", 4096)
    capped = add_norm_occupancy("default+s+r+o8", 4096)
    assert free.registers > 64 >= capped.registers, (free, capped)
    assert (default.ctas_per_sm, free.ctas_per_sm, capped.ctas_per_sm) == (4, 6, 8)
    assert default.local_bytes == free.local_bytes == 0
    assert round(default.waves(1024), 2) == 1.94 and capped.waves(1024) < 1


def test_the_band_kernels_hold_more_rows_an_sm():
    """Why the bands pick the kernels without a grid-stride loop: at H=4096 the default kernel
    takes 100 registers (4 rows an SM, T=1024 in 1.94 waves), without the loop 70 (7 rows), and
    reading gamma late as well 64 (8 rows: T=1024 in one wave, as FlashInfer's kernel)."""
    from .occupancy import add_norm_occupancy

    rows = {name: add_norm_occupancy(name, 4096) for name in ("default", "default+late+nl", "default+late+g+nl", "128x1+s+l1+late+g+nl")}
    assert [occ.rows_per_sm for occ in rows.values()] == [4, 7, 8, 8], rows
    assert all(occ.local_bytes == 0 for occ in rows.values())
    assert rows["default+late+g+nl"].waves(1024) < 1 < rows["default+late+nl"].waves(1024)


def test_a_one_warp_row_needs_no_barrier(tmp_path):
    from layer_boundary_cutedsl.kernels.compiler import compile_variant

    one_warp = compile_variant(AddNormVariant(torch.bfloat16, 2048, layout=(32, 4)), "sm_90a", keep_ptx_dir=str(tmp_path)).__ptx__
    two_warps = compile_variant(AddNormVariant(torch.bfloat16, 2048, layout=(64, 2)), "sm_90a", keep_ptx_dir=str(tmp_path)).__ptx__
    assert "bar.sync" not in one_warp and "barrier" not in one_warp
    assert "bar.sync" in two_warps or "barrier.sync" in two_warps


@pytest.mark.parametrize("variant", MOE + MOE_TOP_K, ids=lambda v: v.name)
def test_moe_finalize_compiles(variant, tmp_path):
    _compile(variant, tmp_path)


def test_variant_matrix_is_complete():
    assert len(ADD_NORM) == 2 * 9 * 2
    assert len(MOE) == 2 * 9 * 2 * 2 * 3
    assert {v.shared for v in MOE} == {False, True} and {v.weight_offset for v in MOE} == {0.0, 1.0}


@pytest.mark.parametrize(
    "variant, row_vectors",
    [
        (AddNormVariant(torch.bfloat16, 4096), (2, 2)),  # x, residual in; residual, norm out
        (AddNormVariant(torch.float16, 2880, 1.0), (2, 2)),
        (MoeVariant(torch.bfloat16, 7168, 8, indexed=True, shared=True), (8 + 2, 2)),
        (MoeVariant(torch.bfloat16, 4096, 4, indexed=False, norm=False), (4, 1)),
    ],
    ids=lambda v: v.name if hasattr(v, "name") else "",
)
def test_ptx_uses_16_byte_vectors_for_sm_90a(variant, row_vectors, tmp_path):
    """Row traffic is all 128-bit (v4.b32) loads and stores; no local-memory stack frame."""
    from layer_boundary_cutedsl.kernels.compiler import compile_variant

    ptx = compile_variant(variant, "sm_90a", keep_ptx_dir=str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    vpt = variant.tiling().vpt
    loads, stores = row_vectors
    gamma = vpt if getattr(variant, "norm", True) else 0
    assert ptx.count("ld.global.v4.b32") == loads * vpt + gamma
    assert ptx.count("st.global.v4.b32") == stores * vpt
    assert ".local" not in ptx
    # scalar global loads are the routing table only (index + weight per slot)
    scalar = ptx.count("ld.global.b32")
    top_k = getattr(variant, "top_k", 0)
    assert scalar == (2 * top_k if getattr(variant, "indexed", False) else top_k)


def recording_executor(count: int):
    """(a stand-in for the JitExecutor attributes FastCall reads, the packed pointer lists of its
    calls, its CUDA error slot): each call records its first `count` argument pointers."""
    import ctypes

    seen = []
    result = ctypes.c_int32(0)

    class FakeExecutor:
        _has_cuda_result = True
        _cuda_result_addr = ctypes.addressof(result)
        _kernel_ptrs = None
        cuda_result = result

        @staticmethod
        def capi_func(packed):
            seen.append([packed[i] for i in range(count)])

    return FakeExecutor, seen, result


@pytest.mark.parametrize("variant", [AddNormVariant(torch.bfloat16, 4096), MoeVariant(torch.bfloat16, 2880, 6, shared=True)], ids=lambda v: v.name)
def test_fast_launch_packs_what_the_dsl_marshals(variant):
    """The wrappers' ctypes fast path passes the same argument values as the DSL's own
    (slow) marshalling, followed by the executor's error slot; checked without a GPU."""
    import ctypes

    from layer_boundary_cutedsl.kernels._launch import FastCall, pack_kinds
    from layer_boundary_cutedsl.kernels.compiler import compile_variant

    compiled = compile_variant(variant, "sm_90a")
    n_addr = 5 if isinstance(variant, AddNormVariant) else 8
    FakeExecutor, seen, result = recording_executor(n_addr + 5)
    launcher = FastCall(FakeExecutor, pack_kinds(n_addr))
    probe = (*range(0x7F0000001000, 0x7F0000001000 + 16 * n_addr, 16), 4097, 1e-5, 2112, 0xABC0)
    assert launcher.matches(compiled.execution_args, probe)
    launcher(*probe)
    packed = seen[-1]
    assert packed[-1] == ctypes.addressof(result)
    values = [ctypes.c_int64.from_address(p).value for p in packed[:n_addr]]
    assert values == list(probe[:n_addr])
    assert ctypes.c_int32.from_address(packed[n_addr]).value == 4097
    assert ctypes.c_float.from_address(packed[n_addr + 1]).value == pytest.approx(1e-5)
    assert ctypes.c_void_p.from_address(packed[n_addr + 3]).value == 0xABC0
    result.value = 700  # an error code from the launch is raised
    with pytest.raises(RuntimeError, match="700"):
        launcher(*probe)


QK_NORM_ROPE = [
    QKNormRopeVariant(dtype, head_dim, heads, kv_heads, pdl)
    for dtype, head_dim, heads, kv_heads, pdl in (
        (torch.bfloat16, 128, 32, 8, True),
        (torch.float16, 64, 4, 1, True),
        (torch.bfloat16, 256, 8, 2, False),
    )
]


@pytest.mark.parametrize("variant", QK_NORM_ROPE, ids=lambda v: v.name)
def test_qk_norm_rope_compiles_with_no_divergent_shuffle(variant, tmp_path):
    """The head-row groups shuffle with a full mask: every lane must reach every shuffle (a row
    past the end recomputes the last row instead of branching around them)."""
    _compile(variant, tmp_path)


GATED = [GatedActivationVariant(dtype, act, d, pdl) for dtype, act, d, pdl in (
    (torch.bfloat16, "silu", 12288, True), (torch.float16, "gelu_tanh", 1408, True), (torch.bfloat16, "gelu", 8, False))]


@pytest.mark.parametrize("variant", GATED, ids=lambda v: v.name)
def test_gated_activation_compiles(variant, tmp_path):
    _compile(variant, tmp_path)
