"""The local add + RMSNorm kernels on a GPU (skipped without one): every installed candidate
against the core's torch path over T 1..32768, H 2048/4096/7168/8192, bf16/fp16, RMSNorm and
Gemma; the order they are chosen in; and a qwen3 TP=1 bf16 decode step launching fewer kernels
with them than without, its logits within the bf16 bar.

Bars, against `RMSNorm.add_forward` (which rounds the normalized value before the weight
multiply, where the kernels round once): the new residual within one rounding (u) of the
torch path, the normed output within 3u relative plus 3u absolute (u = 2^-8 bf16, 2^-11 fp16).
"""

import importlib
import importlib.util

import pytest
import torch

from layer_boundary import GemmaRMSNorm, Parallel, RMSNorm
from layer_boundary._residual import kernels
from layer_boundary.plugin import get_registry, reset_registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TOKENS = (1, 3, 16, 128, 1024, 8192, 32768)
HIDDEN = (2048, 4096, 7168, 8192)
#: record name -> (module with `factory`, the library it needs)
CANDIDATES = {
    "cutedsl.add_rmsnorm": ("layer_boundary_cutedsl.local_add_norm", "cutlass"),
    "flashinfer.add_rmsnorm": ("layer_boundary_flashinfer.local_add_norm", "flashinfer"),
}


def _needs(library):
    if importlib.util.find_spec(library) is None:
        pytest.fail(f"{library} is not importable: the GPU run must stage it (scripts/gpu_tests.sh stage)")


def _norm(norm_cls, hidden, dtype, seed=0):
    norm = norm_cls(hidden, eps=1e-6, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        base = 0.0 if norm.offset else 1.0
        norm.weight.copy_(base + 0.1 * torch.randn(hidden, generator=g, device="cuda"))
    return norm


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm], ids=["rms", "gemma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("name", list(CANDIDATES))
@torch.inference_mode()
def test_candidate_matches_the_torch_path(name, hidden, dtype, norm_cls):
    module, library = CANDIDATES[name]
    _needs(library)
    factory = importlib.import_module(module).factory
    norm = _norm(norm_cls, hidden, dtype, seed=hidden)
    request = kernels.request_for(norm, norm.weight.device, dtype, dtype)
    kernel = factory(request)
    assert kernel is not None, f"{name} declined {request}: {factory.reason(request)}"
    u = U[dtype]
    g = torch.Generator(device="cuda").manual_seed(7)
    for tokens in TOKENS:
        c = (torch.randn(tokens, hidden, generator=g, device="cuda") * 2).to(dtype)
        r = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
        held_c, held_r = c.clone(), r.clone()
        normed, new_residual = kernel(c, r, norm.weight)
        want_normed, want_residual = norm.add_forward(c, r)
        torch.cuda.synchronize()
        where = f"{name} T={tokens} H={hidden} {dtype} {norm_cls.__name__}"
        assert torch.equal(c, held_c) and torch.equal(r, held_r), f"{where}: an input was written"
        assert normed.shape == want_normed.shape and new_residual.dtype == dtype
        torch.testing.assert_close(new_residual.float(), want_residual.float(), rtol=u, atol=u, msg=lambda m: f"{where} residual: {m}")
        torch.testing.assert_close(normed.float(), want_normed.float(), rtol=3 * u, atol=3 * u, msg=lambda m: f"{where} normed: {m}")
        del c, r, held_c, held_r, normed, new_residual, want_normed, want_residual


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm], ids=["rms", "gemma"])
@pytest.mark.parametrize("shape", [(1, 32, 128), (7, 8, 128), (300, 4096), (1, 7168)], ids=str)
@torch.inference_mode()
def test_plain_norm_kernel_matches_the_torch_path(shape, norm_cls):
    """The norm without an add (Qwen3's per-head q/k norms, a first layer's input norm) runs the
    first record's `norm_factory` (FlashInfer's rmsnorm; cutedsl offers none): against the torch
    path, which rounds before the weight multiply, within 3u; a new tensor, x untouched."""
    _needs("flashinfer")
    norm = _norm(norm_cls, shape[-1], torch.bfloat16, seed=shape[0])
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
    held = x.clone()
    got = norm(x)
    torch.cuda.synchronize()
    assert kernels.choose_norm(norm, x.device, x.dtype).name == "flashinfer.add_rmsnorm"
    assert torch.equal(x, held) and got.data_ptr() != x.data_ptr() and got.shape == x.shape
    u = U[torch.bfloat16]
    torch.testing.assert_close(got.float(), norm.torch_forward(x).float(), rtol=3 * u, atol=3 * u)


@torch.inference_mode()
def test_the_chain_picks_by_priority_and_declines_what_no_kernel_runs(monkeypatch):
    for _, library in CANDIDATES.values():
        _needs(library)
    reset_registry()
    names = [r.name for r in get_registry().add_norm_kernels]
    assert names.index("cutedsl.add_rmsnorm") < names.index("flashinfer.add_rmsnorm")
    assert _norm(RMSNorm, 4096, torch.bfloat16).add_norm_kernel() == "cutedsl.add_rmsnorm"
    assert _norm(GemmaRMSNorm, 4096, torch.float16).add_norm_kernel() == "cutedsl.add_rmsnorm"
    assert _norm(RMSNorm, 4096, torch.float32).add_norm_kernel() == kernels.TORCH
    assert RMSNorm(4096, dtype=torch.bfloat16).add_norm_kernel() == kernels.TORCH  # a CPU norm
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "cutedsl")
    reset_registry()
    try:
        assert _norm(RMSNorm, 4096, torch.bfloat16).add_norm_kernel() == "flashinfer.add_rmsnorm"
        from layer_boundary_flashinfer.local_add_norm import implementation

        print(f"flashinfer fused_add_rmsnorm implementation: {implementation()}")
    finally:
        monkeypatch.delenv("LAYER_BOUNDARY_DISABLE_PLUGINS")
        reset_registry()


@torch.inference_mode()
def test_kernels_run_inside_a_cuda_graph():
    _needs("cutlass")
    norm = _norm(RMSNorm, 4096, torch.bfloat16)
    c = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    eager = norm.fused_add_forward(c, r)  # chooses and compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm.fused_add_forward(c, r)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def _qwen3(layers=2):
    from layer_boundary.bench.decode import _random_init
    from layer_boundary_models.presets import realistic
    from layer_boundary_models import build_model, model_config

    config = model_config("qwen3", dict(realistic("qwen3"), num_hidden_layers=layers))
    model = build_model(config, Parallel.single(), dtype=torch.bfloat16, device="cuda")
    _random_init(model)
    return config, model.eval()


def _use_kernels(model, on: bool) -> None:
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernels = on
            kernels.forget(module)


@pytest.mark.parametrize("batch", [1, 32])
@torch.inference_mode()
def test_qwen3_tp1_decode_step_launches_fewer_kernels_with_the_plugin(batch):
    from layer_boundary.bench.profile import profile_step
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill

    _needs("cutlass")
    config, model = _qwen3()
    parallel = Parallel.single()
    cache = model.new_static_cache(batch, 48)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, config.vocab_size, (16,), generator=gen) for _ in range(batch)]
    static_prefill(model, parallel, cache, prompts, "cuda")
    slots = torch.arange(batch, device="cuda")
    ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).cuda()
    pos = torch.full((batch,), 16, dtype=torch.long, device="cuda")

    def step():  # the same token at the same position: rewrites the same cache entries
        return static_decode_step(model, parallel, cache, ids, slots, pos)

    results = {}
    for on in (False, True):
        _use_kernels(model, on)
        logits = step().float().clone()
        results[on] = (profile_step(step), logits)
    chosen = {m.add_norm_kernel() for m in model.modules() if isinstance(m, RMSNorm) and m.weight.shape[0] == config.hidden_size}
    without, with_ = results[False][0], results[True][0]
    print(f"batch {batch}: kernels {without['kernels']} -> {with_['kernels']}, kernel time {without['kernel_us']:.1f} -> "
          f"{with_['kernel_us']:.1f} us, norms run {sorted(chosen)}")
    assert chosen == {"cutedsl.add_rmsnorm"}
    plain = {kernels.choose_norm(m, m.weight.device, m.weight.dtype).name for m in model.modules() if isinstance(m, RMSNorm)}
    assert plain == {"flashinfer.add_rmsnorm"}, plain  # the q/k norms and the input norm: FlashInfer's rmsnorm
    assert with_["kernels"] < without["kernels"], (without, with_)
    ref, got = results[False][1], results[True][1]
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 3e-2, f"logits with the kernels differ by {rel:.3e} relative (bf16 bar 3e-2)"
