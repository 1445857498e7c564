"""The FFN output reduction policy: `ar`, `rs`, `rsv`, `rs+rsv`, and `auto` per architecture.

Policies are permissions for optional transport, not commands: an ineligible reduce-scatter
falls back to the all-reduce path. `auto` must be resolved before the model is built.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ._contracts import ReductionPolicy

__all__ = ["ARCHITECTURE_DEFAULTS", "resolve_reduction", "require_resolved", "architecture_of"]

#: Per-architecture defaults for `auto`; anything else resolves to `rs+rsv`.
ARCHITECTURE_DEFAULTS: Mapping[str, ReductionPolicy] = {
    # dense Qwen3: the FFN output is small and the next input fuses its all-reduce
    "Qwen3ForCausalLM": ReductionPolicy.AR,
    "Qwen3Model": ReductionPolicy.AR,
    "Qwen3ForSequenceClassification": ReductionPolicy.AR,
    "qwen3": ReductionPolicy.AR,
    # LongCat-Flash and Bailing MoE-linear: attention DP with variable-size reduce-scatter
    "LongcatFlashForCausalLM": ReductionPolicy.RSV,
    "BailingMoeLinearForCausalLM": ReductionPolicy.RSV,
    "Step3VLForConditionalGeneration": ReductionPolicy.RSV,
}
DEFAULT = ReductionPolicy.RS_RSV
_WRAPPED_CONFIGS = ("text_config", "llm_config", "language_config")


def architecture_of(config: Any) -> Optional[str]:
    """The first architecture name of a Hugging Face config (or dict), unwrapping VLM configs."""
    if config is None:
        return None
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    for key in _WRAPPED_CONFIGS:
        inner = get(key)
        if inner is not None:
            found = architecture_of(inner)
            if found:
                return found
    archs = get("architectures") or ()
    if archs:
        return archs[0]
    return get("model_type")


def resolve_reduction(policy, config: Any = None) -> ReductionPolicy:
    """A concrete policy: `policy` itself, or for `auto` the default of `config`'s architecture."""
    policy = ReductionPolicy(policy)
    if policy is not ReductionPolicy.AUTO:
        return policy
    arch = architecture_of(config)
    if arch in ARCHITECTURE_DEFAULTS:
        return ARCHITECTURE_DEFAULTS[arch]
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type") if config is not None else None
    return ARCHITECTURE_DEFAULTS.get(model_type, DEFAULT)


def require_resolved(policy) -> ReductionPolicy:
    try:
        policy = ReductionPolicy(policy)
    except ValueError:
        raise ValueError(f"unknown reduction policy {policy!r}; choose one of ar, rs, rsv, rs+rsv, auto") from None
    if policy is ReductionPolicy.AUTO:
        raise ValueError("boundary_reduction must be resolved before model construction")
    return policy
