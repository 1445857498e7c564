"""The external oracle of `layer-boundary run --check hf`: a family's Hugging Face reference
(`ModelFamily.reference`, or by default the config's `model_type` causal LM, eager attention and
eager experts, holding the run's weights) run unsharded over the same prompts and decode tokens.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from .._families import ConfigError
from .._plugins.requests import HfReference, ReferenceRequest

__all__ = ["require_transformers", "hf_model_builder", "reference_of", "hf_from_state", "hf_logits"]

_EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def require_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError("--check hf needs Hugging Face transformers: pip install 'layer-boundary[oracle]'") from None
    return transformers


def hf_model_builder(hf_config: dict, dtype: torch.dtype, state: Optional[dict] = None, checkpoint: Optional[str] = None):
    """`build(**options)`: the Hugging Face causal LM of `hf_config` in `dtype` (eager attention
    and experts unless `options` say otherwise) holding exactly `state`, or loaded from
    `checkpoint`: what `ReferenceRequest.hf_model` is."""

    def build(**options):
        transformers = require_transformers()
        options = {**_EAGER, **options}
        if checkpoint is not None:
            return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, **options).eval()
        cfg = dict(hf_config)
        model_type = cfg.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        model = transformers.AutoModelForCausalLM.from_config(config, **options).to(dtype).eval()
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model

    return build


def reference_of(fam, config, dtype: torch.dtype, *, state=None, checkpoint=None, requests: int = 0, options=None) -> HfReference:
    """Family `fam`'s reference for this run: its `reference(request)`, else the default model."""
    build = hf_model_builder(dict(config.hf), dtype, state, checkpoint)
    if fam.reference is None:
        return HfReference(build())
    request = ReferenceRequest(config=config, dtype=dtype, hf_model=build, requests=requests, options=dict(options or {}))
    found = fam.reference(request)
    return found if isinstance(found, HfReference) else HfReference(found)


def hf_from_state(hf_config: dict, state: dict, dtype: torch.dtype):
    """The reference model of `hf_config` holding exactly `state`, as `run --check hf` builds it
    (the registered family of its model_type, or the default model)."""
    from .._plugins.manager import get_registry

    found = [r.record for r in get_registry().model_families if r.record.model_type == hf_config.get("model_type")]
    if not found:
        return hf_model_builder(hf_config, dtype, state)()
    fam = found[0]
    return reference_of(fam, fam.parse(dict(hf_config)), dtype, state=state).model


@torch.inference_mode()
def hf_logits(reference, prompts: Sequence[torch.Tensor], decode_tokens: Sequence[Sequence[int]], adapters=None) -> list[list[torch.Tensor]]:
    """Per request: [prefill logits [L, V], then one [1, V] per decode step], of an
    `HfReference` or a bare model (`adapters`: each request's peft adapter name).

    Where a model only upcasts its head's output (Nemotron-H returns float32 logits from a
    float64 model), the head's output is taken instead, so a float64 comparison is not hidden
    behind float32 rounding; any other post-processing (a soft cap) keeps the model's logits.
    """
    if not isinstance(reference, HfReference):
        kwargs = None if adapters is None else tuple({"adapter_names": [a]} for a in adapters)
        reference = HfReference(reference, kwargs)
    model = reference.model
    head_out: list = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: head_out.append(output))
    try:
        out = []
        for r, prompt in enumerate(prompts):
            extra = {} if reference.request_kwargs is None else dict(reference.request_kwargs[r])
            res = model(prompt[None], use_cache=True, **extra)
            cache = res.cache if hasattr(res, "cache") and res.cache is not None else res.past_key_values
            steps = [_logits(res, head_out)]
            for tokens in decode_tokens:
                res = model(torch.tensor([[tokens[r]]]), cache=cache, use_cache=True, **extra)
                cache = res.cache if getattr(res, "cache", None) is not None else res.past_key_values
                steps.append(_logits(res, head_out))
            out.append(steps)
    finally:
        hook.remove()
    return out


def _logits(res, head_out: list) -> torch.Tensor:
    head = head_out.pop()[0]
    head_out.clear()
    logits = res.logits[0]
    if head.dtype != logits.dtype and head.shape == logits.shape and torch.equal(head.to(logits.dtype), logits):
        return head.clone()
    return logits.clone()
