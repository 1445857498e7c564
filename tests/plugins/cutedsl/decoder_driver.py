"""Run a reference decoder (prefill, then decode steps) with the CuTe DSL plugin on or off.

Shared by the CPU model tests (reference kernels, float64, threaded ranks) and the GPU ones
(the real kernels, bf16). Every request sits on every rank (no attention DP), so each rank
returns all logits.
"""

import torch

from layer_boundary import Forward, ForwardMode
from layer_boundary_models import build_model, family, model_config
from layer_boundary.plugin import StepLayout
from layer_boundary.cli.runner import make_requests
from layer_boundary.cli.sources import open_source
from layer_boundary_cutedsl import CuteDSLFusion, install_cutedsl_fusion, prepare_cutedsl_fusion

#: qwen3_moe, hidden a multiple of 8 with several warps' worth of columns, a Gemma final norm, a
#: dense layer in the middle, a shared expert: every fused path of the plugin is on the way
MOE_CONFIG = dict(
    model_config("qwen3_moe").hf,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    num_hidden_layers=4,
    mlp_only_layers=[1],
    layer_boundary_final_norm="gemma",
)


def requests(config, batch=3, prompt=5, steps=2, seed=3):
    return make_requests(config.vocab_size, batch, prompt, steps, seed)


@torch.inference_mode()
def run_decoder(parallel, hf_config, state, prompts, decode, *, dtype, device="cpu", cutedsl=None, model_name="qwen3_moe"):
    """{request: [prefill logits, decode logits...]} on this rank, and the service (or None).

    `cutedsl`: None (plugin off) or a dict: `kernels` (a KernelSet, default the CuTe DSL ones),
    `terminal_finalize` (default True), `max_tokens` (default 64).
    """
    config = model_config(model_name, hf_config)
    fusions = None
    if cutedsl is not None:
        fusions = CuteDSLFusion(kernels=cutedsl.get("kernels"))
    model = build_model(config, parallel, dtype=dtype, device=device, fusions=fusions)
    family(model_name).load_weights(model, open_source(state))
    service = None
    if cutedsl is not None:
        service = install_cutedsl_fusion(model, terminal_finalize=cutedsl.get("terminal_finalize", True))
        prepare_cutedsl_fusion(model, max_tokens=cutedsl.get("max_tokens", 64))
    cache = model.new_cache()
    rids = list(range(len(prompts)))
    logits = {r: [] for r in rids}
    for index in range(len(decode) + 1):
        if index == 0:
            ids = [torch.tensor(p) for p in prompts]
            step = StepLayout(rids, [len(p) for p in prompts], [0] * len(rids), device=device)
            mode = ForwardMode.EXTEND
        else:
            ids = [torch.tensor([decode[index - 1][r]]) for r in rids]
            step = StepLayout(rids, [1] * len(rids), [len(prompts[r]) + index - 1 for r in rids], device=device)
            mode = ForwardMode.DECODE
        fwd = Forward(parallel, step.num_tokens, mode=mode)
        out = model(torch.cat(ids).to(device), fwd, step, cache)
        for r, s, c in zip(step.rids, step.starts, step.counts):
            logits[r].append(out[s : s + c].double().cpu())
    return logits, service, model


def max_rel_diff(a, b) -> float:
    worst, scale = 0.0, 0.0
    for r in a:
        for x, y in zip(a[r], b[r]):
            worst = max(worst, (x - y).abs().max().item())
            scale = max(scale, y.abs().max().item())
    return worst / scale
