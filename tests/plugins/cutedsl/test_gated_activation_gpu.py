"""The CuTe DSL gated activation on a GPU (group `cutedsl`): act(gate) * up against the float64
reference for every activation, widths and token counts that leave the last CTA partly empty,
CTAs looping, a CUDA graph, the record's factory, and the choice in a qwen3 model.

Tolerance: the output is rounded once (u*|ref|); the fp32 math before it (ex2.approx for silu's
exp, tanh, erf) stays below 2^-20 relative of act(g)*u, far under u; so 1.01*u*|ref| + 1e-6.
"""

import importlib.util
import math

import pytest
import torch

from layer_boundary_cutedsl.kernels import _launch
from layer_boundary_cutedsl.kernels.gated_activation import gated_activation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not importable"),
]

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    if activation == "silu":
        act = g * torch.sigmoid(g)
    elif activation == "gelu_tanh":
        act = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    else:
        act = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    return act * u


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("tokens,d,dtype", [(1, 12288, torch.bfloat16), (3, 1408, torch.float16), (33, 8, torch.bfloat16),
                                            (300, 1536, torch.bfloat16)])
@pytest.mark.parametrize("max_ctas", [None, 3], ids=["grid_per_vectors", "ctas_loop"])
@torch.inference_mode()
def test_the_kernel_matches_the_reference(activation, tokens, d, dtype, max_ctas, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_CTAS", max_ctas)
    gen = torch.Generator(device="cuda").manual_seed(tokens + d)
    gate_up = (torch.randn(tokens, 2 * d, device="cuda", generator=gen) * 3).to(dtype)
    before = gate_up.clone()
    got = gated_activation(gate_up, activation)
    assert got.shape == (tokens, d) and got.dtype == dtype and torch.equal(gate_up, before)
    want = _reference(gate_up, activation)
    err = (got.double() - want).abs()
    assert bool((err <= 1.01 * U[dtype] * want.abs() + 1e-6).all()), err.max().item()


@torch.inference_mode()
def test_a_cuda_graph_replays_the_kernel_on_new_inputs():
    gate_up = torch.randn(32, 2 * 12288, device="cuda").bfloat16()
    gated_activation(gate_up)  # loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_activation(gate_up)
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    assert torch.equal(out, gated_activation(gate_up))


@torch.inference_mode()
def test_the_factory_accepts_what_the_kernel_runs_and_declines_the_rest():
    from layer_boundary.plugin import GatedActivationRequest
    from layer_boundary_cutedsl.gated_activation_kernel import factory

    def request(**kw):
        fields = dict(device=torch.device("cuda"), dtype=torch.bfloat16, activation="silu", intermediate=1536)
        fields.update(kw)
        return GatedActivationRequest(**fields)

    assert factory(request(activation="relu2")) is None
    assert factory(request(dtype=torch.float32)) is None
    assert factory(request(intermediate=12)) is None
    assert factory(request(device=torch.device("cpu"))) is None
    kernel = factory(request())
    gate_up = torch.randn(4, 3072, device="cuda").bfloat16()
    assert torch.equal(kernel(gate_up), gated_activation(gate_up, "silu"))
    torch.library.opcheck(torch.ops.layer_boundary_cutedsl.gated_activation.default, (gate_up, "silu"))


@torch.inference_mode()
def test_qwen3_chooses_it_and_decodes_within_bf16_of_the_torch_path():
    from layer_boundary import Parallel, prepare_model, release_model
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill
    from layer_boundary.cli.runner import make_requests

    from .test_qk_norm_rope_gpu import _qwen3

    config, model = _qwen3()
    parallel = Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 3, 5, 2, seed=6)
    base = torch.tensor([len(p) for p in prompts], device="cuda")

    def run_all():
        cache = model.new_static_cache(len(prompts), 32)
        out = [static_prefill(model, parallel, cache, prompts, "cuda").float()]
        for s, tokens in enumerate(decode):
            out.append(static_decode_step(model, parallel, cache, torch.tensor(tokens, device="cuda"), None, base + s).float())
        return out

    want = run_all()
    prepare_model(model, max_tokens=64)
    (_, choice), = model.mlp_kernels.items()
    assert choice.name == "cutedsl.gated_activation", choice
    got = run_all()
    worst = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    assert worst < 3e-2, worst
    release_model(model)
