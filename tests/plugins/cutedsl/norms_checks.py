"""Checks of the norms kernels (post-norm, sandwich, LayerNorm), run on every rank of a world: the
GPU tests (test_norms_gpu.py) assert them on CUDA, test_norms_cpu.py runs the one-shot check dry
on CPU ranks (the float64 reference protocol over fake peer memory).

Each returns one dict per launch: {"case", "rank", "ok", "err_normed", "err_residual",
"vs_unfused", "digest", "detail"}; `err_*` are max |kernel - float64 reference| / max |reference|
(ok: within `TOL`), `vs_unfused` the same against the unfused path (the group's all-reduce, then
the local kernel), `digest` a hash of the outputs (every rank must report the same).
"""

from __future__ import annotations

import hashlib

import torch

from layer_boundary_cutedsl.kernels.norms import NormsShape
from layer_boundary_cutedsl.kernels.reference import add_norms_reference

__all__ = ["SHAPES", "TOL", "inputs", "check_oneshot_norms", "model_rank", "GPU_MODELS"]

#: Gemma's sandwich, OLMo-2's post-norm (identity read), a post-norm before a plain RMSNorm,
#: GPT-NeoX's LayerNorm (bias), Cohere's (no bias)
SHAPES = {
    "sandwich": NormsShape("rms", 1.0, post=True, post_offset=1.0),
    "post_norm": NormsShape("none", post=True),
    "post_rms": NormsShape("rms", post=True),
    "layer_bias": NormsShape("layer", bias=True),
    "layer": NormsShape("layer"),
}
#: the bf16 bar for the normed rows and the residual, relative to the largest reference element
TOL = {"normed": 2e-2, "residual": 1e-2}
EPS, POST_EPS = 1e-5, 1e-6


def _digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _rel(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def inputs(shape, world, tokens, hidden, dtype, device, seed):
    """Every rank's partial, the residual and the weights (the same on every rank: one seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    parts = [randn(tokens, hidden) for _ in range(world)]
    residual = randn(tokens, hidden, scale=2.0)
    gamma = None if shape.norm == "none" else ((0.0 if shape.weight_offset else 1.0) + randn(hidden, scale=0.1).float()).to(dtype)
    beta = randn(hidden, scale=0.1) if shape.bias else None
    post_gamma = ((0.0 if shape.post_offset else 1.0) + randn(hidden, scale=0.1).float()).to(dtype) if shape.post else None
    return parts, residual, gamma, beta, post_gamma


def reference(shape, parts, residual, gamma, beta, post_gamma):
    """The float64 reference of the group: the exact sum (rounded to the dtype before a post-norm,
    as the kernels complete it), then `add_norms_reference` in float64."""
    total = sum(p.double() for p in parts)
    if shape.post:
        total = total.to(residual.dtype)
    return add_norms_reference(total, residual, gamma, beta, post_gamma, EPS, POST_EPS, shape, exact=True)


def _row(case, rank, normed, res, ref, vs_unfused):
    err_n, err_r = _rel(normed, ref[0]), _rel(res, ref[1])
    ok = err_n <= TOL["normed"] and err_r <= TOL["residual"] and (vs_unfused is None or vs_unfused <= TOL["normed"])
    return {"case": case, "rank": rank, "ok": bool(ok), "err_normed": err_n, "err_residual": err_r, "vs_unfused": vs_unfused,
            "digest": _digest(normed, res), "detail": ""}


def check_oneshot_norms(parallel, hidden=2048, token_counts=(1, 7, 133), *, dry=False, seed=0):
    """The one-shot all-reduce with each shape's norms at each token count, on one workspace,
    against float64 and against the unfused path; `dry`: CPU ranks, the reference protocol."""
    from layer_boundary_cutedsl.oneshot import CUDA_ONESHOT, create_workspace

    group = parallel.groups["tp"]
    if dry:
        from layer_boundary_cutedsl.testing import reference_oneshot

        device, kernels = torch.device("cpu"), reference_oneshot()
        local = add_norms_reference
    else:
        from layer_boundary_cutedsl.kernels.norms import fused_add_norms

        from .allreduce_checks import use_rank_device

        device, kernels, local = use_rank_device(parallel), CUDA_ONESHOT, fused_add_norms
    dtype = torch.bfloat16
    ws, why = create_workspace(group, kernels, dtype=dtype, hidden=hidden, max_tokens=max(token_counts), device=device,
                               weight_offsets=(0.0, 1.0), norm_shapes=tuple(SHAPES.values()))
    if ws is None:
        raise RuntimeError(f"no one-shot workspace: {why}")
    out = []
    try:
        for i, (name, shape) in enumerate(SHAPES.items()):
            for j, tokens in enumerate(token_counts):
                parts, residual, gamma, beta, post_gamma = inputs(shape, group.size, tokens, hidden, dtype, device, seed * 100 + 10 * i + j)
                normed, res = ws.all_reduce_add_norms(parts[group.rank], residual, gamma, beta, post_gamma, EPS, POST_EPS, shape)
                total = group.all_reduce(parts[group.rank].clone())  # the unfused path: the group's sum, then the local kernel
                u_normed, u_res = local(total, residual, gamma, beta, post_gamma, EPS, POST_EPS, shape)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                vs = max(_rel(normed, u_normed), _rel(res, u_res))
                out.append(_row(f"oneshot {name} h{hidden} T={tokens}", group.rank, normed, res,
                                reference(shape, parts, residual, gamma, beta, post_gamma), vs))
        ws.check()
    finally:
        ws.release()
    return out


#: the GPU model tests' width: four warps a row, so the block reductions run
GPU_MODELS = {
    "gemma3": {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
               "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo2": {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
              "num_hidden_layers": 2},
    "gpt_neox": {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_hidden_layers": 2,
                 "use_parallel_residual": False},
}


def counting_kernels(counts):
    """The CuTe DSL kernels, each one-shot norms launch and local norms call counted in `counts`."""
    from dataclasses import replace

    from layer_boundary_cutedsl.kernel_set import CUTEDSL_KERNELS

    def wrap(name, fn):
        def run(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return run

    one = CUTEDSL_KERNELS.oneshot
    return replace(CUTEDSL_KERNELS, oneshot=replace(one, all_reduce_add_norms=wrap("oneshot_add_norms", one.all_reduce_add_norms)),
                   fused_add_rmsnorm=wrap("fused_add_rmsnorm", CUTEDSL_KERNELS.fused_add_rmsnorm))


def model_rank(parallel, name, state, prompts, decode, plugin: bool, dtype=torch.bfloat16):
    """One rank's logits of `name` (GPU_MODELS' config) with the CuTe DSL fusion on (counted) or
    off, and the counts and the workspace's reason when it has none."""
    from layer_boundary_models import family

    from .allreduce_checks import use_rank_device
    from .decoder_driver import run_decoder

    device = use_rank_device(parallel)
    counts: dict = {}
    cutedsl = {"kernels": counting_kernels(counts), "terminal_finalize": False} if plugin else None
    hf = dict(family(name).preset(), **GPU_MODELS[name])
    logits, service, _ = run_decoder(parallel, hf, state, prompts, decode, dtype=dtype, device=str(device), cutedsl=cutedsl,
                                     model_name=name)
    reason = ""
    if service is not None:
        reason = service.oneshot_reason if service.oneshot is None else ""
        service.release()
    return logits, counts, reason
