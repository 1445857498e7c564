"""The CuTe DSL q/k norm + rope kernel on a GPU (group `cutedsl` of scripts/gpu_tests.sh): against
the float64 reference of its math, against the core's unfused torch path, over the strided views a
fused q/k/v projection leaves, in a CUDA graph, and the record's factory.

Tolerance against the reference (elementwise): the output is rounded once (u*|ref|, u = 2^-8
bf16, 2^-11 fp16); before that, the normalized value is rounded to the dtype in both, and the
kernel's fp32 norm (a sum of D squares, rsqrt.approx) can land on the other side of a rounding
boundary than float64 does: one unit of the normalized value, on the element and on its rotation
partner, so u*(|n| + |n_partner|) more, bounded here by 2u * the head row's largest |n|.
"""

import importlib.util

import pytest
import torch

from layer_boundary.plugin import rope_cos_sin_table
from layer_boundary_cutedsl.kernels import _launch
from layer_boundary_cutedsl.kernels.qk_norm_rope import fused_qk_norm_rope
from layer_boundary_cutedsl.kernels.reference import qk_norm_rope_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not importable"),
]

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
EPS = 1e-6
MAX_POSITIONS = 4096


def _inputs(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q and k as views of one fused projection output [T, (heads + 2 kv_heads) * D] (rows strided)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    fused = (torch.randn(tokens, width, device="cuda", generator=gen) * 3).to(dtype)
    q, k, _ = fused.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    q_w = (1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    k_w = (1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), device="cuda", generator=gen)
    return fused, q, k, q_w, k_w, positions


def _within(got, x, positions, weight, table):
    want = qk_norm_rope_reference(x, positions, weight, table, EPS).double()
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    u = U[x.dtype]
    tol = u * want.abs() + 2 * u * normed.abs().amax(-1, keepdim=True) + 1e-6
    err = (got.double() - want).abs()
    return bool((err <= tol).all()), err.max().item()


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,dtype",
    [
        (1, 32, 8, 128, torch.bfloat16),
        (5, 4, 1, 128, torch.bfloat16),
        (33, 32, 8, 128, torch.bfloat16),
        (300, 8, 2, 128, torch.float16),
        (7, 4, 2, 64, torch.bfloat16),
        (9, 8, 1, 256, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("max_ctas", [None, 3], ids=["grid_per_rows", "ctas_loop"])
@torch.inference_mode()
def test_the_kernel_matches_the_reference_on_strided_views(tokens, heads, kv_heads, head_dim, dtype, max_ctas, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_CTAS", max_ctas)
    fused, q, k, q_w, k_w, positions = _inputs(tokens, heads, kv_heads, head_dim, dtype)
    before = fused.clone()
    table = rope_cos_sin_table(head_dim, 1e6, MAX_POSITIONS, "cuda")
    q_out, k_out = fused_qk_norm_rope(q, k, positions, q_w, k_w, table, EPS)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(fused, before), "the inputs were written"
    for got, x, w in ((q_out, q, q_w), (k_out, k, k_w)):
        ok, worst = _within(got, x, positions, w, table)
        assert ok, f"max error {worst}"


@torch.inference_mode()
def test_the_kernel_matches_the_core_torch_path():
    """The core's unfused path: RMSNorm modules on q and k, then `apply_rotary` with its own table."""
    from layer_boundary import RMSNorm
    from layer_boundary_models.attention import RotaryEmbedding, apply_rotary

    heads, kv_heads, D, tokens = 32, 8, 128, 17
    fused, q, k, q_w, k_w, positions = _inputs(tokens, heads, kv_heads, D, torch.bfloat16, seed=3)
    q_norm, k_norm = RMSNorm(D, EPS, dtype=torch.bfloat16, device="cuda"), RMSNorm(D, EPS, dtype=torch.bfloat16, device="cuda")
    q_norm.weight.copy_(q_w)
    k_norm.weight.copy_(k_w)
    cos, sin = RotaryEmbedding(D, 1e6)(positions, torch.bfloat16)
    want_q, want_k = apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)
    got_q, got_k = fused_qk_norm_rope(q, k, positions, q_w, k_w, rope_cos_sin_table(D, 1e6, MAX_POSITIONS, "cuda"), EPS)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert rel < 2e-2, rel


@torch.inference_mode()
def test_a_cuda_graph_replays_the_kernel_for_new_positions():
    heads, kv_heads, D, tokens = 32, 8, 128, 32
    fused, q, k, q_w, k_w, positions = _inputs(tokens, heads, kv_heads, D, torch.bfloat16, seed=5)
    table = rope_cos_sin_table(D, 1e6, MAX_POSITIONS, "cuda")
    static = positions.clone()
    fused_qk_norm_rope(q, k, static, q_w, k_w, table, EPS)  # loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = fused_qk_norm_rope(q, k, static, q_w, k_w, table, EPS)
    later = (positions * 7 + 11) % MAX_POSITIONS
    static.copy_(later)
    fused.mul_(-0.5)  # new inputs in the same buffer
    graph.replay()
    want_q, want_k = fused_qk_norm_rope(q, k, later, q_w, k_w, table, EPS)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)


@torch.inference_mode()
def test_bad_inputs_are_refused_with_the_fix():
    heads, kv_heads, D = 4, 1, 128
    fused, q, k, q_w, k_w, positions = _inputs(3, heads, kv_heads, D, torch.bfloat16)
    table = rope_cos_sin_table(D, 1e6, 64, "cuda")
    with pytest.raises(ValueError, match="heads back to back"):
        fused_qk_norm_rope(torch.empty(3, D, heads, dtype=q.dtype, device="cuda").transpose(1, 2), k, positions, q_w, k_w, table, EPS)
    with pytest.raises(ValueError, match="int64"):
        fused_qk_norm_rope(q, k, positions.int(), q_w, k_w, table, EPS)
    with pytest.raises(ValueError, match="float32"):
        fused_qk_norm_rope(q, k, positions, q_w, k_w, table.bfloat16(), EPS)
    with pytest.raises(TypeError, match="bf16/fp16"):
        fused_qk_norm_rope(q.float(), k.float(), positions, q_w.float(), k_w.float(), table, EPS)


def _request(**overrides):
    from layer_boundary.plugin import QKNormRopeRequest

    fields = dict(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, heads=32, kv_heads=8, theta=1e6,
                  max_positions=MAX_POSITIONS, eps=EPS)
    fields.update(overrides)
    return QKNormRopeRequest(**fields)


@torch.inference_mode()
def test_the_factory_accepts_what_the_kernel_runs_and_declines_the_rest():
    from layer_boundary_cutedsl.qk_norm_rope_kernel import factory

    assert factory(_request(dtype=torch.float32)) is None
    assert factory(_request(head_dim=96)) is None
    assert factory(_request(device=torch.device("cpu"))) is None
    kernel = factory(_request())
    assert kernel is not None
    fused, q, k, q_w, k_w, positions = _inputs(4, 32, 8, 128, torch.bfloat16, seed=9)
    got = kernel(q, k, positions, q_w, k_w)
    want = fused_qk_norm_rope(q, k, positions, q_w, k_w, rope_cos_sin_table(128, 1e6, MAX_POSITIONS, "cuda"), EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _qwen3(layers=2):
    from layer_boundary import Parallel
    from layer_boundary_models import build_model, family, model_config
    from layer_boundary.plugin import StateDictSource

    hf = dict(model_config("qwen3").hf, head_dim=128, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=layers)
    config = model_config("qwen3", hf)
    state = family("qwen3").random_weights(config, torch.float32, seed=11)
    model = build_model(config, Parallel.single(), dtype=torch.bfloat16, device="cuda")
    family("qwen3").load_weights(model, StateDictSource(state))
    return config, model.eval()


def _launches(profile, needle):
    return sum(count for name, count in profile["by_name"] if needle in name)


@torch.inference_mode()
def test_qwen3_static_decode_runs_the_fused_kernel_and_matches_the_torch_path():
    """prepare_model chooses cutedsl.qk_norm_rope for qwen3's attention; prefill and decode logits
    stay within bf16 of the torch path; a decode step launches it once a layer, with no separate
    q/k norm; a CUDA graph of the step equals its eager step; compiled fullgraph it is one op."""
    from layer_boundary import Forward, ForwardMode, Parallel, prepare_model, release_model
    from layer_boundary._cuda_graphs import CapturedStep
    from layer_boundary.bench.profile import profile_step
    from layer_boundary.compiling import CountingBackend, graph_breaks, reset_graph_breaks
    from layer_boundary.plugin import DecodeLayout
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill
    from layer_boundary.cli.runner import make_requests

    layers = 2
    config, model = _qwen3(layers)
    parallel = Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 4, 6, 3, seed=4)
    base = torch.tensor([len(p) for p in prompts], device="cuda")

    def run_all(cache):
        out = [static_prefill(model, parallel, cache, prompts, "cuda").float()]
        for s, tokens in enumerate(decode):
            out.append(static_decode_step(model, parallel, cache, torch.tensor(tokens, device="cuda"), None, base + s).float())
        return out

    want = run_all(model.new_static_cache(len(prompts), 32))
    prepare_model(model, max_tokens=64)
    assert model.attention_kernels.qk_norm_rope.name == "cutedsl.qk_norm_rope", model.attention_kernels
    cache = model.new_static_cache(len(prompts), 32)
    got = run_all(cache)
    worst = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    assert worst < 3e-2, f"logits with the fused q/k norm + rope differ by {worst:.3e} relative (bf16 bar 3e-2)"

    ids = torch.tensor(decode[0], device="cuda")
    step = profile_step(lambda: static_decode_step(model, parallel, cache, ids, None, base), top=200)
    assert _launches(step, "QKNormRopeKernel") == layers, step["by_name"]
    assert _launches(step, "QKRMSNorm") == 0 and _launches(step, "ApplyRotary") == 0, step["by_name"]

    graph = CapturedStep(lambda i, p: static_decode_step(model, parallel, cache, i, None, p), (ids.clone(), base.clone()))
    for s, tokens in enumerate(decode):
        tokens = torch.tensor(tokens, device="cuda")
        snap = cache.snapshot()
        eager = static_decode_step(model, parallel, cache, tokens, None, base + s).clone()
        cache.restore(snap)
        assert torch.equal(eager, graph.replay(tokens, base + s).clone()), f"step {s}"

    torch._dynamo.reset()
    reset_graph_breaks()
    run = torch.compile(model, backend=CountingBackend("aot_eager"), fullgraph=True)
    snap = cache.snapshot()
    eager = static_decode_step(model, parallel, cache, ids, None, base).clone()
    cache.restore(snap)
    compiled = run(ids, Forward(parallel, len(ids), mode=ForwardMode.DECODE), DecodeLayout(None, base), cache)
    assert ((compiled.float() - eager.float()).abs().max() / eager.float().abs().max()).item() < 1e-2
    assert graph_breaks() == 0
    release_model(model)
