"""The norms kernels of post-norm, sandwich and LayerNorm layers on the GPU.

    python -m pytest -q -m gpu tests/plugins/cutedsl/test_norms_gpu.py

- the local kernel ("cutedsl.local_norms") against float64 and the unfused torch path (the
  post-norm, then the add + norm): within bf16; the new residual bitwise where the unfused path's
  is a plain add (LayerNorm), within one bf16 ulp after a post-norm (whose rounded output the
  kernel and torch may round apart); replayed from a CUDA graph bit for bit;
- models (gemma3's sandwich, olmo2's post-norm, gpt_neox's LayerNorm) over one rank: a decode step
  launches the local norms kernel twice a layer (each completion one call, the last one at the
  final norm) and no separate norm or add + norm; logits within the bf16 bar of float64;
- the one-shot all-reduce variant at 2 ranks (norms_checks.check_oneshot_norms), and the models
  at TP=2 with the CuTe DSL fusion: each completion but the last layer's MLP sum is one one-shot
  launch.
"""

import importlib.util

import pytest
import torch

from layer_boundary import GemmaRMSNorm, LayerNorm, Parallel, RMSNorm, Topology
from layer_boundary_models import family, model_config

from .norms_checks import EPS, GPU_MODELS, POST_EPS, SHAPES, TOL, check_oneshot_norms, inputs, model_rank, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not importable"),
]

BF16_BAR = 3e-2
CASE_TIMEOUT = 240.0


def _rel(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _torch_completion(shape, x, residual, gamma, beta, post_gamma):
    """The unfused path in torch, as the core runs it without kernels: the post-norm module's
    torch norm, then the read norm's torch add + norm."""
    hidden, dtype = x.shape[-1], x.dtype
    if shape.post:
        post = (GemmaRMSNorm if shape.post_offset else RMSNorm)(hidden, POST_EPS, dtype=dtype, device=x.device)
        with torch.no_grad():
            post.weight.copy_(post_gamma)
        x = post.torch_forward(x)
    if shape.norm == "none":
        total = (x.float() + residual.float()).to(dtype)
        return total, total
    if shape.norm == "layer":
        norm = LayerNorm(hidden, EPS, bias=shape.bias, dtype=dtype, device=x.device)
    else:
        norm = (GemmaRMSNorm if shape.weight_offset else RMSNorm)(hidden, EPS, dtype=dtype, device=x.device)
    with torch.no_grad():
        norm.weight.copy_(gamma)
        if shape.bias:
            norm.bias.copy_(beta)
    return norm.add_forward(x, residual)


@pytest.mark.parametrize("hidden", [4096, 2880])
@torch.inference_mode()
@pytest.mark.parametrize("name", list(SHAPES))
def test_local_kernel_vs_float64_and_the_unfused_path(name, hidden):
    from layer_boundary_cutedsl.kernels.norms import fused_add_norms

    shape = SHAPES[name]
    for i, tokens in enumerate((1, 7, 133)):
        (x,), residual, gamma, beta, post_gamma = inputs(shape, 1, tokens, hidden, torch.bfloat16, "cuda", seed=i)
        normed, res = fused_add_norms(x, residual, gamma, beta, post_gamma, EPS, POST_EPS, shape)
        ref_normed, ref_res = reference(shape, [x], residual, gamma, beta, post_gamma)
        assert _rel(normed, ref_normed) <= TOL["normed"] and _rel(res, ref_res) <= TOL["residual"], (tokens,)
        u_normed, u_res = _torch_completion(shape, x, residual, gamma, beta, post_gamma)
        assert _rel(normed, u_normed) <= TOL["normed"], (tokens, _rel(normed, u_normed))
        if not shape.post:  # a plain add: the new residual is the unfused one bit for bit
            assert torch.equal(res, u_res)
        else:  # the post-norm's rounded output may differ by its last bit (torch's RMSNorm rounds twice), then the sum's rounding
            post = _torch_completion(SHAPES["post_norm"], x, torch.zeros_like(residual), None, None, post_gamma)[1] if not shape.post_offset \
                else (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + POST_EPS) * (1 + post_gamma.float()))
            bound = 2.0**-6 * (post.float().abs() + u_res.float().abs()) + 1e-30
            assert bool(((res.float() - u_res.float()).abs() <= bound).all()), (tokens, (res.float() - u_res.float()).abs().max())
        assert not shape.norm == "none" or normed is res


@pytest.mark.parametrize("name", ["sandwich", "post_norm", "layer_bias"])
def test_the_record_runs_in_a_cuda_graph(name):
    """The record's kernel (compiled by its factory) replays from a captured graph bit for bit."""
    from layer_boundary.plugin import AddNormRequest, NormSpec, PostNormRequest
    from layer_boundary_cutedsl.local_add_norm import norms_factory

    shape = SHAPES[name]
    hidden, dtype, device = 4096, torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    spec = dict(weight_dtype=dtype, compute_dtype=torch.float32)
    if shape.post:
        read = (NormSpec(norm_kind="none") if shape.norm == "none"
                else NormSpec(norm_kind="gemma_rms" if shape.weight_offset else "rms", offset=shape.weight_offset, eps=EPS, **spec))
        request = PostNormRequest(device=device, dtype=dtype, contribution_dtype=dtype, hidden_size=hidden, norm=read,
                                  post=NormSpec(norm_kind="gemma_rms" if shape.post_offset else "rms", offset=shape.post_offset,
                                                eps=POST_EPS, **spec))
        kernel = norms_factory.post_norm_factory(request)
    else:
        request = AddNormRequest(device=device, dtype=dtype, contribution_dtype=dtype, weight_dtype=dtype, hidden_size=hidden, offset=0.0,
                                 eps=EPS, compute_dtype=torch.float32, norm_kind="layer", bias=shape.bias)
        kernel = norms_factory(request)
    assert kernel is not None
    (x,), residual, gamma, beta, post_gamma = inputs(shape, 1, 16, hidden, dtype, device, seed=5)
    args = (x, residual, post_gamma, None, gamma, beta) if shape.post else (x, residual, gamma, beta)
    eager = [t.clone() for t in kernel(*args)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, out))


class _plugins_off:
    """The kernel plugins switched off for a block (LAYER_BOUNDARY_DISABLE_PLUGINS, the registry
    reloaded): the torch path of every norm."""

    def __enter__(self):
        import os

        from layer_boundary.plugin import DISABLE_ENV, reset_registry

        self.saved = os.environ.get(DISABLE_ENV)
        os.environ[DISABLE_ENV] = "cutedsl,flashinfer"
        reset_registry()

    def __exit__(self, *exc):
        import os

        from layer_boundary.plugin import DISABLE_ENV, reset_registry

        if self.saved is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = self.saved
        reset_registry()


def _launches(profile, needle):
    return sum(count for name, count in profile["by_name"] if needle in name)


def _config_state(name):
    config = model_config(name, dict(family(name).preset(), **GPU_MODELS[name]))
    return config, family(name).random_weights(config, torch.float32, seed=7)


def _model(name, dtype, device="cuda"):
    from layer_boundary_models import build_model
    from layer_boundary.plugin import StateDictSource

    config, state = _config_state(name)
    model = build_model(config, Parallel.single(), dtype=dtype, device=device)
    family(name).load_weights(model, StateDictSource(state))
    return config, state, model.eval()


@pytest.mark.parametrize("name", list(GPU_MODELS))
@torch.inference_mode()
def test_a_decode_step_completes_each_sum_in_one_local_norms_call(name):
    """Over one rank every completion is the local norms kernel: twice a layer (attention output
    at the MLP input, MLP output at the next input or the final norm), no separate norm kernel
    and no add + RMSNorm; logits within the bf16 bar of the float64 model (or as close as the
    bf16 torch path is: random sandwich weights make gemma3's bf16 logits noisy)."""
    from layer_boundary import Forward, ForwardMode, prepare_model
    from layer_boundary.bench.profile import profile_step
    from layer_boundary.plugin import StepLayout

    from .decoder_driver import max_rel_diff, requests, run_decoder

    config, state = _config_state(name)
    prompts, decode = requests(config, batch=3, prompt=5, steps=2)
    hf = dict(family(name).preset(), **GPU_MODELS[name])
    exact, _, _ = run_decoder(Parallel.single(), hf, state, prompts, decode, dtype=torch.float64, device="cuda", model_name=name)
    with _plugins_off():
        off, _, _ = run_decoder(Parallel.single(), hf, state, prompts, decode, dtype=torch.bfloat16, device="cuda", model_name=name)
    on, _, _ = run_decoder(Parallel.single(), hf, state, prompts, decode, dtype=torch.bfloat16, device="cuda", model_name=name)
    err_on, err_off = max_rel_diff(on, exact), max_rel_diff(off, exact)
    assert err_on < max(BF16_BAR, 2 * err_off), (err_on, err_off)

    config, state, model = _model(name, torch.bfloat16)
    prepare_model(model, max_tokens=64)  # chooses (compiles) every norm's kernel

    cache = model.new_cache()
    parallel = Parallel.single()
    rids = list(range(len(prompts)))
    step = StepLayout(rids, [len(p) for p in prompts], [0] * len(rids), device="cuda")
    model(torch.cat([torch.tensor(p) for p in prompts]).cuda(), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache)
    ids = torch.tensor(decode[0], device="cuda")
    position = [len(p) for p in prompts]

    def decode_step():  # each call one step further (the cache grows by a token a request)
        step = StepLayout(rids, [1] * len(rids), list(position), device="cuda")
        position[:] = [p + 1 for p in position]
        return model(ids, Forward(parallel, len(rids), mode=ForwardMode.DECODE), step, cache)

    profile = profile_step(decode_step, top=200)
    layers = config.num_layers
    assert _launches(profile, "AddNormsKernel") == 2 * layers, profile["by_name"]
    assert _launches(profile, "AddRMSNormKernel") == 0, profile["by_name"]


def test_oneshot_norms_at_two_ranks(gpu_world):
    """Each shape at 1, 7 and 133 tokens (a CTA loops over rows past the SM count): within the
    bf16 bar of float64 and of the unfused path (the group's all-reduce, then the local kernel);
    the ranks bit-identical."""
    per_rank = gpu_world(2).run(check_oneshot_norms, Topology(tp=2), 4096, (1, 7, 133), timeout=CASE_TIMEOUT)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in by_case.values()), by_case


@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_models_at_tp2_complete_each_sum_in_one_oneshot_launch(gpu_world, name):
    from .decoder_driver import max_rel_diff, requests

    config, state = _config_state(name)
    prompts, decode = requests(config, batch=3, prompt=5, steps=2)
    world = gpu_world(2)
    exact = world.run(model_rank, Topology(tp=2), name, state, prompts, decode, False, torch.float64, timeout=CASE_TIMEOUT)
    off = world.run(model_rank, Topology(tp=2), name, state, prompts, decode, False, timeout=CASE_TIMEOUT)
    on = world.run(model_rank, Topology(tp=2), name, state, prompts, decode, True, timeout=CASE_TIMEOUT)
    steps = 1 + len(decode)
    for (ref, _, _), (unfused, _, _), (logits, counts, reason) in zip(exact, off, on):
        assert not reason, f"no one-shot workspace: {reason}"
        err_on, err_off = max_rel_diff(logits, ref), max_rel_diff(unfused, ref)
        assert err_on < max(BF16_BAR, 2 * err_off), (err_on, err_off)
        # two sums a layer, each one launch, but the last MLP's (before the final norm, in the MLP)
        assert counts.get("oneshot_add_norms") == (2 * config.num_layers - 1) * steps, counts
        assert not counts.get("fused_add_rmsnorm"), counts
    assert on[0][1] == on[1][1]
