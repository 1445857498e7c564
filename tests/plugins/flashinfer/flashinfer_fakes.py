"""Helpers for the flashinfer plugin's CPU tests: small models and on/off runs through the
reference backend (`layer_boundary_flashinfer.testing`, shipped with the plugin)."""

from __future__ import annotations

import torch

from layer_boundary_models import build_model, family, model_config
from layer_boundary.plugin import StateDictSource
from layer_boundary_flashinfer.testing import FakeWorkspace, ReferenceBackend, hardware_present, reference_add_norm, uncounted  # noqa: F401
from layer_boundary_flashinfer.workspace import WorkspaceManager

#: small model configs (hidden a multiple of 8) for the CPU plumbing runs
CONFIGS = {
    "qwen3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96},
    "qwen3_moe": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96,
                  "moe_intermediate_size": 16, "mlp_only_layers": [2]},
    "gemma": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96},
    # residual shapes the fused patterns do not take: sandwich and post-norms, LayerNorm reads
    "gemma3": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "olmo2": {"num_hidden_layers": 3},
    "gpt_neox": {"num_hidden_layers": 3, "use_parallel_residual": False},
}

family("qwen3")  # load the model families now: `models._load` is not safe when threads race into it


def tiny_model(name, parallel, dtype=torch.float32, seed=3, **extra):
    cfg = dict(family(name).preset(), **CONFIGS[name], **extra)
    config = model_config(name, cfg)
    model = build_model(config, parallel, dtype=dtype)
    family(name).load_weights(model, StateDictSource(family(name).random_weights(config, dtype, seed)))
    return config, model.eval()


def prompt_batches(config, sizes=(5, 1, 3), seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in sizes]


@torch.inference_mode()
def model_logits(model, parallel, prompts):
    """Prefill `prompts` (one request each, batched) then one decode step; logits of both."""
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.plugin import StepLayout

    cache = model.new_cache()
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts))
    prefill = model(torch.cat(prompts), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache)
    step = StepLayout(slots, [1] * len(prompts), [len(p) for p in prompts])
    ids = torch.stack([p[0] for p in prompts])
    decode = model(ids, Forward(parallel, len(prompts), mode=ForwardMode.DECODE), step, cache)
    return prefill, decode


def on_off_run(parallel, name, backend_options, max_tokens=64, collectives=False, config_extra=None):
    """One rank: logits unfused (before prepare), then after prepare with a ReferenceBackend;
    the report, the launch counts and both logits. Module-level so gloo workers can run it.
    `collectives`: build the model on `flashinfer_collectives(parallel)`."""
    from layer_boundary_flashinfer.collectives import flashinfer_collectives
    from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

    backend = ReferenceBackend(**backend_options)
    manager = WorkspaceManager(backend)
    if collectives:
        parallel = flashinfer_collectives(parallel)
    with hardware_present():
        config, model = tiny_model(name, parallel, **(config_extra or {}))
    prompts = prompt_batches(config)
    unfused = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model, max_tokens=max_tokens, manager=manager)
    fused = model_logits(model, parallel, prompts)
    manager.shutdown()
    return {
        "report": report,
        "unfused": unfused,
        "fused": fused,
        "launches": {k: backend.count(k, parallel.rank) for k in ("all_reduce", "finalize")
                     + (("plain_all_reduce",) if collectives else ()) + (("all_reduce_fp8",) if config_extra else ())},
        "after_release": model_logits(model, parallel, prompts) if collectives else None,
        "events": [e for e in backend.events if e[1] == parallel.groups["tp"].rank],
    }
