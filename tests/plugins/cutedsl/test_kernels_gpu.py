"""The CuTe DSL kernels against the float64 references, on a GPU (skipped without one).

Tolerances (elementwise, against the exact float64 value `ref`):
- an output rounded once to bf16/fp16 is off by at most u*|ref| (u = 2^-8 bf16, 2^-11 fp16);
- before that rounding the kernel's fp32 value carries (a) the sum of squares over H terms,
  all positive, so at most H*2^-24 relative, plus rsqrt.approx (2^-22.9) and the final products,
  together below (H + 8)*2^-24 relative; (b) for the MoE sum, an fp32 accumulation of top_k + 2
  terms whose error is at most (top_k + 3)*2^-24*sum|terms| (absolute: cancellation can make it
  large relative to the result), which the norm scales by rstd*|gamma|.
- the add + norm kernel's new residual is bit-exact: fp32 x + r rounded once, as torch does it.
A tiny absolute 1e-6 covers fp16 subnormals.
"""

import importlib.util

import pytest
import torch

from layer_boundary import MoeFinalizeHandoff
from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary_cutedsl.kernels import (
    add_rmsnorm_reference,
    finalize_handoff_add_rmsnorm,
    fused_add_rmsnorm,
    moe_finalize,
    moe_finalize_add_rmsnorm,
    moe_finalize_add_rmsnorm_reference,
    moe_finalize_reference,
)
from layer_boundary_cutedsl.kernels.reference import moe_terms_abs_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not importable"),
]

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
U32 = 2.0**-24
ATOL = 1e-6
EPS = 1e-6


def _check(name, got, ref, bound):
    err = (got.double() - ref).abs()
    excess = err - bound
    worst = int(excess.argmax())
    row, col = divmod(worst, ref.shape[-1])
    assert not bool((excess > 0).any()), (
        f"{name}: {int((excess > 0).sum())} elements out of bound; worst at [{row}, {col}]: "
        f"got {got.reshape(-1)[worst].item()}, ref {ref.reshape(-1)[worst].item()}, bound {bound.reshape(-1)[worst].item()}"
    )


def _norm_bound(ref_normed, dtype, hidden, extra=0.0):
    return (U[dtype] + (hidden + 8) * U32) * ref_normed.abs() + extra + ATOL


def _gamma(hidden, offset, dtype, gen):
    g = torch.randn(hidden, generator=gen, device="cuda") * 0.1
    return (g if offset else 1.0 + g).to(dtype)


def _check_add_norm(x, r, gamma, offset, normed, res):
    dtype, hidden = x.dtype, x.shape[-1]
    assert torch.equal(res, (x.float() + r.float()).to(dtype)), "new residual is not fp32 x + r rounded once"
    ref_normed, _ = add_rmsnorm_reference(x, r, gamma, EPS, weight_offset=offset, exact=True)
    _check("normed", normed, ref_normed, _norm_bound(ref_normed, dtype, hidden))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden", [1024, 2048, 2880, 4096, 5120, 7168, 8192])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_add_rmsnorm(dtype, hidden, offset, tokens):
    gen = torch.Generator(device="cuda").manual_seed(hidden * 31 + tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    r = (torch.randn(tokens, hidden, generator=gen, device="cuda") * 3).to(dtype)
    gamma = _gamma(hidden, offset, dtype, gen)
    normed, res = fused_add_rmsnorm(x, r, gamma, EPS, weight_offset=offset)
    torch.cuda.synchronize()
    _check_add_norm(x, r, gamma, offset, normed, res)


@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("max_ctas", [None, 37])
def test_many_rows_and_ctas_looping_over_rows(hidden, max_ctas, monkeypatch):
    """5000 rows; with 37 CTAs each loops over ~135 rows, alternating its reduction slots."""
    from layer_boundary_cutedsl.kernels import _launch

    monkeypatch.setattr(_launch, "MAX_CTAS", max_ctas)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(5000, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    # rows of very different scale: a stale reduction slot would show as a wrong rstd
    r = (torch.randn(5000, hidden, generator=gen, device="cuda") * torch.logspace(-3, 3, 5000, device="cuda")[:, None]).to(torch.bfloat16)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    normed, res = fused_add_rmsnorm(x, r, gamma, EPS)
    torch.cuda.synchronize()
    _check_add_norm(x, r, gamma, 0.0, normed, res)


#: multi-row CTAs (threads per row, rows per CTA): a one-warp row (no barrier), two- and four-warp
#: rows, two and four rows a CTA
LAYOUTS = [(32, 4), (64, 2), (64, 4), (128, 1), (128, 2), (256, 1)]


@pytest.mark.parametrize("hidden", [2048, 2880, 4096, 7168, 8192])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay[0]}x{lay[1]}")
@pytest.mark.parametrize("tokens", [5, 301])
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_row_layouts(hidden, layout, tokens, max_ctas, monkeypatch):
    _check_layout(hidden, layout, False, tokens, max_ctas, monkeypatch)


@pytest.mark.parametrize("hidden", [2048, 2880, 4096, 8192])
@pytest.mark.parametrize("layout", [None, (64, 2), (128, 1)], ids=lambda lay: "default" if lay is None else f"{lay[0]}x{lay[1]}")
@pytest.mark.parametrize("tokens", [1, 301])
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_staged_loads(hidden, layout, tokens, max_ctas, monkeypatch):
    """x and the residual through shared memory (cp.async) give the same answer; a row too
    wide to stage in 48 KiB is refused when the kernel is asked for."""
    from layer_boundary_cutedsl.kernels.tiling import AddNormVariant

    try:
        AddNormVariant(torch.bfloat16, hidden, layout=layout, staged=True)
    except ValueError as exc:
        assert "shared memory" in str(exc)
        return
    _check_layout(hidden, layout, True, tokens, max_ctas, monkeypatch)


@pytest.mark.parametrize(
    "hidden, layout, ctas_per_sm",
    [(2880, None, 0), (4096, None, 0), (4096, None, 8), (4096, (128, 2), 4), (4096, (64, 2), 4), (2048, (256, 1), 0)],
    ids=lambda v: "default" if v is None else (f"{v[0]}x{v[1]}" if isinstance(v, tuple) else str(v)),
)
@pytest.mark.parametrize("tokens", [1, 301])
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_reread_from_shared_memory(hidden, layout, ctas_per_sm, tokens, max_ctas, monkeypatch):
    """The staged row summed again from shared memory for the norm (and with the registers
    capped for an occupancy) gives the register path's answer: a width with bounds checks,
    multi-row CTAs with rows past the end, CTAs looping over rows (slots reused)."""
    x, r, gamma, normed, res = _check_layout(hidden, layout, True, tokens, max_ctas, monkeypatch, reread=True, ctas_per_sm=ctas_per_sm)
    xx, rr = x.clone(), r.clone()  # in place: the norm over x, the sum over the residual
    fused_add_rmsnorm(xx, rr, gamma, EPS, out=xx, residual_out=rr, weight_offset=1.0, layout=layout, staged=True, reread=True, ctas_per_sm=ctas_per_sm)
    torch.cuda.synchronize()
    assert torch.equal(rr, res) and torch.equal(xx, normed)


@pytest.mark.parametrize(
    "hidden, layout, options",
    [
        (4096, (64, 2), dict(staged=True, l1_staging=True, late_trigger=True, late_gamma=True)),  # FlashInfer's shape and loads
        (4096, (64, 2), dict(staged=True, late_gamma=True)),
        (2880, None, dict(late_gamma=True)),  # bounds-checked vectors
        (2048, (32, 4), dict(staged=True, l1_staging=True, late_gamma=True)),  # one-warp rows, four a CTA
        (4096, None, dict(staged=True, reread=True, late_gamma=True)),
        (8192, (128, 1), dict(staged=True, l1_staging=True)),
        # no grid-stride loop: a CTA per block even where the test caps the grid (max_ctas)
        (4096, None, dict(no_loop=True)),
        (2880, None, dict(no_loop=True)),
        (4096, (64, 2), dict(staged=True, l1_staging=True, late_trigger=True, late_gamma=True, no_loop=True)),
        (2048, (32, 4), dict(no_loop=True)),
        (4096, None, dict(staged=True, reread=True, no_loop=True)),
        # the default tiling without the loop, the trigger at the end, gamma read late or not (band kernels)
        (4096, None, dict(late_trigger=True, no_loop=True)),
        (7168, None, dict(late_trigger=True, late_gamma=True, no_loop=True)),
        (2880, None, dict(late_trigger=True, late_gamma=True, no_loop=True)),
    ],
    ids=lambda v: v if isinstance(v, int) else ("default" if v is None else (f"{v[0]}x{v[1]}" if isinstance(v, tuple) else "+".join(v))),
)
@pytest.mark.parametrize("tokens", [1, 301])
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_late_gamma_and_l1_staging(hidden, layout, options, tokens, max_ctas, monkeypatch):
    """Gamma read per row after the wait, staged copies through L1 and no grid-stride loop
    change where data waits, not the arithmetic: the answer equals the same layout's without
    them bit for bit, new buffers and in place, with rows past the end and (max_ctas) CTAs
    looping over rows, or for a kernel without the loop, a CTA per block regardless."""
    x, r, gamma, normed, res = _check_layout(hidden, layout, options.get("staged", False), tokens, max_ctas, monkeypatch, **{
        k: v for k, v in options.items() if k != "staged"})
    plain = dict(staged=options.get("staged", False), reread=options.get("reread", False))
    want_n, want_r = fused_add_rmsnorm(x, r, gamma, EPS, weight_offset=1.0, layout=layout, **plain)
    xx, rr = x.clone(), r.clone()
    fused_add_rmsnorm(xx, rr, gamma, EPS, out=xx, residual_out=rr, weight_offset=1.0, layout=layout, **options)
    torch.cuda.synchronize()
    assert torch.equal(res, want_r) and torch.equal(normed, want_n)
    assert torch.equal(rr, want_r) and torch.equal(xx, want_n)


@pytest.mark.parametrize("hidden", [2880, 4096])
@pytest.mark.parametrize("layout", [None, (256, 1)], ids=lambda lay: "default" if lay is None else f"{lay[0]}x{lay[1]}")
def test_late_pdl_trigger_in_a_graph_chain(hidden, layout):
    """The trigger at the end (late) chains the same: 20 dependent calls in one CUDA graph equal
    20 eager ones of the same layout launched with the trigger at the start (the layouts' sums
    of squares add in different orders, so each is compared with itself)."""
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(300, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    r = torch.randn(300, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    want_x, want_r = x.clone(), r.clone()
    for _ in range(20):
        fused_add_rmsnorm(want_x, want_r, gamma, EPS, out=want_x, residual_out=want_r, layout=layout, late_trigger=False)
    got_x, got_r = x.clone(), r.clone()
    fused_add_rmsnorm(got_x.clone(), got_r.clone(), gamma, EPS, layout=layout, late_trigger=True)  # load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fused_add_rmsnorm(got_x, got_r, gamma, EPS, out=got_x, residual_out=got_r, layout=layout, late_trigger=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_r, want_r) and torch.equal(got_x, want_x)


def _check_layout(hidden, layout, staged, tokens, max_ctas, monkeypatch, **options):
    """Each layout equals the reference, with a row count that leaves a CTA's last rows empty
    (rows past the end reduce with the others and store nothing) and with CTAs looping.
    Returns (x, residual, gamma, norm, new residual)."""
    from layer_boundary_cutedsl.kernels import _launch

    monkeypatch.setattr(_launch, "MAX_CTAS", max_ctas)
    gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    scale = torch.logspace(-3, 3, tokens, device="cuda")[:, None]  # a stale slot would show as a wrong rstd
    r = (torch.randn(tokens, hidden, generator=gen, device="cuda") * scale).to(torch.bfloat16)
    gamma = _gamma(hidden, 1.0, torch.bfloat16, gen)
    guard = torch.full((tokens + 4, hidden), 7.0, dtype=torch.bfloat16, device="cuda")
    normed, res = guard[:tokens], torch.empty_like(x)
    fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res, weight_offset=1.0, layout=layout, staged=staged, **options)
    torch.cuda.synchronize()
    _check_add_norm(x, r, gamma, 1.0, normed, res)
    assert bool((guard[tokens:] == 7.0).all()), "a row past the end was written"
    return x, r, gamma, normed, res


def test_in_place_and_3d():
    gen = torch.Generator(device="cuda").manual_seed(6)
    hidden = 4096
    x = torch.randn(2, 3, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    r = torch.randn(2, 3, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    x0, r0 = x.clone(), r.clone()
    normed, res = fused_add_rmsnorm(x, r, gamma, EPS, out=x, residual_out=r)
    torch.cuda.synchronize()
    assert normed.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr() and normed.shape == (2, 3, hidden)
    _check_add_norm(x0.view(-1, hidden), r0.view(-1, hidden), gamma, 0.0, normed.view(-1, hidden), res.view(-1, hidden))


def test_zero_tokens_on_gpu():
    x = torch.empty(0, 4096, dtype=torch.bfloat16, device="cuda")
    normed, res = fused_add_rmsnorm(x, x.clone(), torch.ones(4096, dtype=torch.bfloat16, device="cuda"), EPS)
    assert normed.shape == res.shape == (0, 4096)


def test_cuda_graph_capture_and_replay():
    gen = torch.Generator(device="cuda").manual_seed(7)
    hidden, tokens = 4096, 64
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    normed = torch.empty_like(x)
    res = torch.empty_like(r)
    fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res)  # eager first: compile + load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res)
    for _ in range(2):
        x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
        r.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
        normed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _check_add_norm(x, r, gamma, 0.0, normed, res)


#: a by-token-count table of the test's own beside the shipped ROWS_BANDS: FlashInfer's form of
#: the kernel with its grid-stride loop, in one or two middle bands at each width
TEST_BANDS = {
    2048: ((512, 2048, "128x1+s+l1+late+g"),),
    4096: ((384, 768, "128x2+s+l1+late+g"), (768, 2048, "64x2+s+l1+late+g")),
    7168: ((512, 8192, "128x1+s+l1+late+g"),),
    8192: ((512, 2048, "128x1+s+l1+late+g"),),
}


@pytest.mark.parametrize("table", ["shipped", "test"])
@pytest.mark.parametrize("hidden", [2048, 4096, 7168, 8192])
def test_a_plain_call_takes_its_token_counts_kernel(hidden, table, monkeypatch):
    """`layout=AUTO` (a plain call) runs the kernel its band table names for each token count:
    the same answer bit for bit as that kernel asked for by name, at both ends of every band
    and between; `prepare_add_rmsnorm` loads them all, so a capture of any count compiles nothing."""
    from layer_boundary_cutedsl.kernels import _launch, add_rmsnorm, prepare_add_rmsnorm
    from layer_boundary_cutedsl.kernels.tiling import ROWS_BANDS, parse_candidate, pick_band

    bands = ROWS_BANDS if table == "shipped" else TEST_BANDS
    monkeypatch.setattr(add_rmsnorm, "_BANDS", add_rmsnorm.parse_bands(bands))
    counts = sorted({1, 300} | {n for first, end, _ in bands.get(hidden, ()) for n in (first - 1, first, end - 1, end) if n > 0})
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    prepare_add_rmsnorm(torch.bfloat16, hidden)
    loaded = len(_launch._executors)
    for tokens in counts:
        name = pick_band(bands.get(hidden, ()), tokens, "default")
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        want_n, want_r = fused_add_rmsnorm(x, r, gamma, EPS, **parse_candidate(name))
        got_n, got_r = torch.empty_like(x), torch.empty_like(r)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_add_rmsnorm(x, r, gamma, EPS, out=got_n, residual_out=got_r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got_r, want_r) and torch.equal(got_n, want_n), (hidden, tokens, name)
        _check_add_norm(x, r, gamma, 0.0, got_n, got_r)
    assert len(_launch._executors) == loaded, "a plain call needed a kernel prepare_add_rmsnorm had not loaded"


def test_pdl_launch_equals_plain_launch_in_a_graph_chain():
    """The default launch is a programmatic dependent (PDL): each call's CTAs start while the
    previous kernel drains and wait before reading x. A chain of dependent calls in one graph
    (each reading the one before's output) must give what plain launches give, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    hidden, tokens, steps = 8192, 5, 6
    x0 = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    r0 = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    gamma = _gamma(hidden, 0.0, torch.bfloat16, gen)
    outs = {}
    for pdl in (False, True):
        x, r = x0.clone(), r0.clone()
        fused_add_rmsnorm(x.clone(), r.clone(), gamma, EPS, pdl=pdl)  # compile + load before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(steps):  # in place: every call reads what the previous one wrote
                fused_add_rmsnorm(x, r, gamma, EPS, out=x, residual_out=r, pdl=pdl)
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = (x, r)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])


# ---------------------------------------------------------------- MoE finalize


def _moe_inputs(tokens, top_k, hidden, dtype, indexed, shared, gen, skip_fraction=0.15):
    rows = tokens * top_k + 3  # a few unused rows: the routed buffer may be larger
    routed = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
    indices = None
    if indexed:
        indices = torch.randperm(rows, generator=gen, device="cuda")[: tokens * top_k].view(tokens, top_k).to(torch.int32)
        skip = torch.rand(tokens, top_k, generator=gen, device="cuda") < skip_fraction
        indices = torch.where(skip, torch.full_like(indices, -1), indices)
        weights = torch.where(skip, torch.full_like(weights, float("inf")), weights)  # must be ignored
    shared_t = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype) if shared else None
    return routed, indices, weights, shared_t


def _check_moe_norm(routed, indices, weights, shared, residual, gamma, offset, normed, res):
    dtype, hidden = residual.dtype, residual.shape[-1]
    top_k = weights.shape[1]
    ref_normed, ref_total = moe_finalize_add_rmsnorm_reference(
        routed, indices, weights, shared, residual, gamma, EPS, weight_offset=offset, exact=True
    )
    err_total = (top_k + 3) * U32 * moe_terms_abs_sum(routed, indices, weights, shared, residual)
    _check("new residual", res, ref_total, U[dtype] * ref_total.abs() + err_total * (1 + U[dtype]) + ATOL)
    rstd = torch.rsqrt(ref_total.pow(2).mean(-1, keepdim=True) + EPS)
    g = (gamma.double() + offset).abs()
    _check("normed", normed, ref_normed, _norm_bound(ref_normed, dtype, hidden, 2 * rstd * g * err_total))


@pytest.mark.parametrize("hidden", [2880, 4096, 7168])
@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("indexed", [True, False], ids=["perm", "dense"])
@pytest.mark.parametrize("shared", [False, True], ids=["noshared", "shared"])
@pytest.mark.parametrize("mode", ["plain", "gemma", "finalize_only"])
def test_moe_finalize(hidden, top_k, indexed, shared, mode):
    dtype = torch.bfloat16
    tokens = 37
    gen = torch.Generator(device="cuda").manual_seed(hidden + 7 * top_k + 3 * indexed + shared)
    routed, indices, weights, shared_t = _moe_inputs(tokens, top_k, hidden, dtype, indexed, shared, gen)
    if mode == "finalize_only":
        out = moe_finalize(routed, indices, weights, shared=shared_t)
        torch.cuda.synchronize()
        ref = moe_finalize_reference(routed, indices, weights, shared_t, exact=True)
        terms = moe_terms_abs_sum(routed, indices, weights, shared_t, torch.zeros_like(out))
        _check("finalized", out, ref, U[dtype] * ref.abs() + (top_k + 3) * U32 * terms * (1 + U[dtype]) + ATOL)
        return
    offset = 1.0 if mode == "gemma" else 0.0
    residual = (torch.randn(tokens, hidden, generator=gen, device="cuda") * 2).to(dtype)
    gamma = _gamma(hidden, offset, dtype, gen)
    normed, res = moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, EPS, shared=shared_t, weight_offset=offset)
    torch.cuda.synchronize()
    _check_moe_norm(routed, indices, weights, shared_t, residual, gamma, offset, normed, res)


@pytest.mark.parametrize(
    "dtype, hidden, top_k, tokens",
    [
        (torch.float16, 4096, 8, 5),
        (torch.bfloat16, 1024, 2, 1),
        (torch.bfloat16, 8192, 6, 3),
        (torch.bfloat16, 5120, 4, 3000),  # with 37 CTAs: each loops over ~81 rows
    ],
)
def test_moe_finalize_other_shapes(dtype, hidden, top_k, tokens, monkeypatch):
    from layer_boundary_cutedsl.kernels import _launch

    monkeypatch.setattr(_launch, "MAX_CTAS", 37 if tokens > 37 else None)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    routed, indices, weights, shared = _moe_inputs(tokens, top_k, hidden, dtype, True, True, gen)
    residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    gamma = _gamma(hidden, 0.0, dtype, gen)
    res_in = residual.clone()
    normed, res = moe_finalize_add_rmsnorm(routed, indices.long(), weights, residual, gamma, EPS, shared=shared, residual_out=residual)
    torch.cuda.synchronize()
    assert res.data_ptr() == residual.data_ptr()  # in place
    _check_moe_norm(routed, indices, weights, shared, res_in, gamma, 0.0, normed, res)


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_core_handoff(norm_cls):
    """A core MoeFinalizeHandoff ([T, top_k, H] rows, expanded weights) with a core norm module."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    tokens, top_k, hidden, dtype = 9, 4, 2048, torch.bfloat16
    rows = torch.randn(tokens, top_k, hidden, generator=gen, device="cuda").to(dtype)
    weights = torch.rand(1, top_k, generator=gen, device="cuda").expand(tokens, -1)
    group = type("Group", (), {"size": 1})()
    handoff = MoeFinalizeHandoff(rows, weights, torch.zeros(tokens, top_k, dtype=torch.long, device="cuda"), None, group, None)
    norm = norm_cls(hidden, 1e-5, dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen, device="cuda") * 0.1 + (0.0 if norm.offset else 1.0))
    residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    normed, res = finalize_handoff_add_rmsnorm(handoff, residual, norm)
    torch.cuda.synchronize()
    ref_normed, ref_total = moe_finalize_add_rmsnorm_reference(
        rows, None, weights, None, residual, norm.weight.detach(), 1e-5, weight_offset=norm.offset, exact=True
    )
    err = (top_k + 3) * U32 * moe_terms_abs_sum(rows, None, weights, None, residual)
    _check("new residual", res, ref_total, U[dtype] * ref_total.abs() + err * 2 + ATOL)
    rstd = torch.rsqrt(ref_total.pow(2).mean(-1, keepdim=True) + 1e-5)
    g = (norm.weight.detach().double() + norm.offset).abs()
    _check("normed", normed, ref_normed, _norm_bound(ref_normed, dtype, hidden, 2 * rstd * g * err))
    # and the core's own unfused path agrees to bf16 accuracy
    core_normed, _ = norm.add_forward(handoff.finalize_local(), residual)
    assert torch.allclose(normed.float(), core_normed.float(), rtol=2**-5, atol=2**-5)


def test_moe_cuda_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(12)
    tokens, top_k, hidden, dtype = 16, 8, 4096, torch.bfloat16
    routed, indices, weights, shared = _moe_inputs(tokens, top_k, hidden, dtype, True, True, gen)
    residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    gamma = _gamma(hidden, 0.0, dtype, gen)
    normed, res = torch.empty_like(residual), torch.empty_like(residual)
    args = (routed, indices, weights, residual, gamma, EPS)
    moe_finalize_add_rmsnorm(*args, shared=shared, out=normed, residual_out=res)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_finalize_add_rmsnorm(*args, shared=shared, out=normed, residual_out=res)
    routed.copy_(torch.randn(routed.shape, generator=gen, device="cuda"))
    normed.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _check_moe_norm(routed, indices, weights, shared, residual, gamma, 0.0, normed, res)


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_provider_candidates_run_the_kernels(norm_cls):
    """The CuteDSLFusion candidates on real bf16 CUDA tensors (group of one rank)."""
    from layer_boundary import UnreducedOutput
    from layer_boundary_cutedsl.provider import CuteDSLFusion

    gen = torch.Generator(device="cuda").manual_seed(13)
    tokens, top_k, hidden, dtype = 6, 8, 4096, torch.bfloat16
    norm = norm_cls(hidden, 1e-6, dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen, device="cuda") * 0.1 + (0.0 if norm.offset else 1.0))
    plan = type("Plan", (), {"norm": norm})()
    handoff_c, unreduced_c = CuteDSLFusion().attention_input(plan)
    group = type("Group", (), {"size": 1, "all_reduce": staticmethod(lambda x: x)})()
    rows = torch.randn(tokens, top_k, hidden, generator=gen, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
    residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    owed = MoeFinalizeHandoff(rows, weights, torch.zeros(tokens, top_k, dtype=torch.long, device="cuda"), None, group, None)
    out = handoff_c.run(owed, residual, None)
    assert out is not None, "the handoff candidate declined on CUDA bf16 tensors"
    normed, res = out
    torch.cuda.synchronize()
    _check_moe_norm(rows, None, weights, None, residual, norm.weight.detach(), norm.offset, normed, res)
    partial = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    out = unreduced_c.run(UnreducedOutput(partial, group, None, declared=True), residual, None)
    assert out is not None, "the all-reduce candidate declined on CUDA bf16 tensors"
    torch.cuda.synchronize()
    _check_add_norm(partial, residual, norm.weight.detach(), norm.offset, *out)
