"""The flashinfer plugin's gated activation on the GPU (group `decode-kernels` of
scripts/gpu_tests.sh) against the core's torch path: the kernel alone in bf16 against a float32
reference and the torch path, a strided input, a CUDA graph, torch.compile(fullgraph) through
the custom op, then a qwen3 static-cache decode with `prepare_model` choosing it (logits against
the torch path, one launch a layer fewer, a captured step equal to its eager step)."""

import pytest
import torch
from torch import nn

from layer_boundary import prepare_model, release_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

flashinfer = pytest.importorskip("flashinfer")
gated_activation = pytest.importorskip("layer_boundary_flashinfer.gated_activation")

from flashinfer_static_decode import StaticDecode, qwen3, rel  # noqa: E402
from layer_boundary_models.mlp import activation  # noqa: E402
from layer_boundary.plugin import GatedActivationRequest  # noqa: E402

#: the request's activation -> the config name the core's torch path builds it from
CONFIG_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def _kernel(act="silu", d=1536, dtype=torch.bfloat16):
    request = GatedActivationRequest(device=torch.device("cuda"), dtype=dtype, activation=act, intermediate=d)
    kernel = gated_activation.gated_activation_factory(request)
    assert kernel is not None, f"flashinfer.gated_activation declined {act} x {d} {dtype} on this GPU"
    return kernel


def _torch_path(gate_up, act, d):
    gate, up = gate_up.split(d, dim=-1)
    return activation(CONFIG_NAMES[act])(gate) * up


def _rows(tokens, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(tokens, 2 * d, device="cuda", generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("act", sorted(CONFIG_NAMES))
@pytest.mark.parametrize("tokens, d", [(1, 1536), (32, 1536), (257, 768), (32, 12288)])
@torch.inference_mode()
def test_the_kernel_matches_the_torch_path(act, tokens, d):
    kernel = _kernel(act, d)
    gate_up = _rows(tokens, d)
    before = gate_up.clone()
    got = kernel(gate_up)
    assert torch.equal(gate_up, before), "the kernel wrote its input"
    assert got.shape == (tokens, d) and got.dtype == torch.bfloat16
    want32 = _torch_path(gate_up.float(), act, d)
    ours = _torch_path(gate_up, act, d)
    # one bf16 rounding (the kernel: fp32 inside) against two (torch: the activation, the product)
    torch.testing.assert_close(got.float(), want32, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ours.float(), rtol=2e-2, atol=2e-2)
    assert (got.float() - want32).abs().mean() <= (ours.float() - want32).abs().mean() * 1.25 + 1e-6


@torch.inference_mode()
def test_float16_and_a_strided_input():
    kernel = _kernel("silu", 512, torch.float16)
    wide = _rows(16, 1024, torch.float16)
    strided = wide[:, : 2 * 512]  # rows of 2 * 512 elements, 2048 apart
    assert not strided.is_contiguous()
    torch.testing.assert_close(kernel(strided).float(), _torch_path(strided.float(), "silu", 512), rtol=1e-2, atol=1e-2)


@torch.inference_mode()
def test_a_cuda_graph_replays_the_kernel():
    kernel = _kernel("silu", 1536)
    static = _rows(32, 1536, seed=1)
    kernel(static)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(static)
    for seed in (2, 3):
        fresh = _rows(32, 1536, seed=seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, kernel(fresh))


@torch.inference_mode()
def test_compiled_fullgraph_through_the_custom_op_equals_eager():
    from layer_boundary.compiling import CountingBackend, graph_breaks, reset_graph_breaks

    torch._dynamo.reset()
    reset_graph_breaks()
    kernel = _kernel("silu", 1536)
    down = nn.Linear(1536, 64, bias=False, device="cuda", dtype=torch.bfloat16)

    def mlp_tail(gate_up):
        return down(kernel(gate_up * 1.0))

    run = torch.compile(mlp_tail, backend=CountingBackend("aot_eager"), fullgraph=True)
    gate_up = _rows(8, 1536, seed=4)
    assert torch.equal(run(gate_up), mlp_tail(gate_up))
    assert graph_breaks() == 0


def test_the_custom_op_passes_opcheck():
    torch.library.opcheck(torch.ops.layer_boundary_flashinfer.gated_activation.default, (_rows(8, 1536, seed=5), "silu", True))


@torch.inference_mode()
def test_qwen3_static_decode_runs_the_kernel_and_matches_the_torch_path():
    from layer_boundary.bench.profile import profile_step
    from layer_boundary_models.mlp import TPGatedMLP

    config, model = qwen3(intermediate_size=1536)
    run = StaticDecode(config, model)
    want = run.logits(run.new_cache())
    prepare_model(model, max_tokens=64)
    (request, choice), = model.mlp_kernels.items()
    # the first accepting record in registry order: the cutedsl plugin's ranks above where it is installed
    assert choice.name in ("flashinfer.gated_activation", "cutedsl.gated_activation") and request.intermediate == 1536
    cache = run.new_cache()
    worst = max(rel(g, w) for g, w in zip(run.logits(cache), want))
    assert worst < 3e-2, f"logits with the flashinfer kernels differ by {worst:.3e} relative (bf16 bar 3e-2)"

    mlps = [m for m in model.modules() if isinstance(m, TPGatedMLP)]
    fused = profile_step(lambda: run.step(cache, run.ids, run.base))
    for m in mlps:
        m.gated_activation_kernel = None
    unfused = profile_step(lambda: run.step(cache, run.ids, run.base))
    for m in mlps:
        m.gated_activation_kernel = choice.kernel
    print(f"decode step kernels: torch activation {unfused['kernels']} ({unfused['kernel_us']:.1f} us) -> "
          f"{choice.name} {fused['kernels']} ({fused['kernel_us']:.1f} us)")
    assert unfused["kernels"] - fused["kernels"] == config.num_layers, (unfused, fused)
    run.assert_replay_equals_eager(cache)
    release_model(model)
    assert all(m.gated_activation_kernel is None for m in mlps)
