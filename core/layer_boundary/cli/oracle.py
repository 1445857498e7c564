"""The external oracle of `layer-boundary run --check hf`: a family's Hugging Face reference
(`ModelFamily.reference`, or by default the config's `model_type` causal LM, eager attention and
eager experts, holding the run's weights) run unsharded over the same prompts and decode tokens.

It runs on every transformers release in `TRANSFORMERS_RANGE` (the `oracle` extra declares the
same range) and reads what differs between them from the installed code, never from its version
string: the keyword a forward takes its cache under and the output field it returns it in. Each
decode step checks that the cache it got back grew by one token, so a reference that silently
drops its cache (an older forward swallowing an unknown keyword) fails loudly instead of being
compared as a cacheless recomputation.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
from typing import Callable, Optional, Sequence

import torch

from .._families import ConfigError
from .._plugins.requests import HfReference, ReferenceRequest

__all__ = [
    "TRANSFORMERS_RANGE", "require_transformers", "check_transformers_version", "installed_transformers", "hf_model_builder",
    "reference_of", "hf_from_state", "hf_logits", "cache_keyword", "returned_cache", "OracleError",
]

#: the transformers releases the oracle is verified on (pyproject's `oracle` extra says the same)
TRANSFORMERS_RANGE = ">=5.17,<5.26"

_EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}
_INSTALL = "pip install 'layer-boundary[oracle]'"


class OracleError(RuntimeError):
    """The reference did not behave like a Hugging Face causal LM the oracle can trust."""


def installed_transformers() -> Optional[str]:
    """The installed transformers' version (from its metadata, without importing it), or None."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _in_range(version: str) -> bool:
    try:  # a dependency of transformers itself
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        raise ConfigError(f"transformers {version} is installed without its dependency `packaging`: {_INSTALL}") from None
    try:
        return SpecifierSet(TRANSFORMERS_RANGE).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_transformers_version() -> None:
    """One line naming the supported range and the installed version when transformers is
    missing or outside `TRANSFORMERS_RANGE` (read from its metadata: nothing is imported)."""
    version = installed_transformers()
    if version is None:
        raise ConfigError(f"--check hf needs Hugging Face transformers{TRANSFORMERS_RANGE}: {_INSTALL}")
    if not _in_range(version):
        raise ConfigError(
            f"--check hf supports transformers{TRANSFORMERS_RANGE}, installed {version}: "
            f"pip install 'transformers{TRANSFORMERS_RANGE}' (or check against one rank: --check single)"
        )


def require_transformers():
    """transformers, imported, once its version is checked."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_transformers_version()
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"--check hf could not import transformers ({exc}): {_INSTALL}") from None
    return transformers


def hf_model_builder(hf_config: dict, dtype: torch.dtype, state: Optional[dict] = None, checkpoint: Optional[str] = None):
    """`build(fit_state=None, **options)`: the Hugging Face causal LM of `hf_config` in `dtype`
    (eager attention and experts unless `options` say otherwise) holding exactly `state`, or
    loaded from `checkpoint`: what `ReferenceRequest.hf_model` is. `fit_state(state, model)`
    returns the state in the layout the installed transformers built (a family's weights in a
    layout one release changed); a checkpoint folder loads as saved."""

    def build(fit_state: Optional[Callable] = None, **options):
        transformers = require_transformers()
        options = {**_EAGER, **options}
        if checkpoint is not None:
            return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, **options).eval()
        cfg = dict(hf_config)
        model_type = cfg.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        model = transformers.AutoModelForCausalLM.from_config(config, **options).to(dtype).eval()
        fitted = state if fit_state is None else fit_state(state, model)
        model.load_state_dict({k: v.to(dtype) for k, v in fitted.items()}, strict=True)
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


def cache_keyword(model) -> str:
    """The keyword `model`'s forward takes its cache under: `cache` (transformers 5.24 on, where
    `past_key_values` is a deprecated alias) or `past_key_values` (before it; such a forward
    takes an unknown `cache=` into its **kwargs and ignores it). Read from the signature of the
    forward that runs (through a peft wrapper to the model it wraps; HF's deprecation decorator
    keeps the signature)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise OracleError(f"{type(base).__name__}.forward takes its cache under neither `cache` nor `past_key_values`")


def returned_cache(output):
    """The cache a Hugging Face model's output carries: `cache` (5.24 on) or `past_key_values`."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _cache_length(cache) -> Optional[int]:
    length = getattr(cache, "get_seq_length", None)
    return None if length is None else int(length())


@torch.inference_mode()
def hf_logits(reference, prompts: Sequence[torch.Tensor], decode_tokens: Sequence[Sequence[int]], adapters=None) -> list[list[torch.Tensor]]:
    """Per request: [prefill logits [L, V], then one [1, V] per decode step], of an
    `HfReference` or a bare model (`adapters`: each request's peft adapter name).

    Where a model only upcasts its head's output (Nemotron-H returns float32 logits from a
    float64 model), the head's output is taken instead, so a float64 comparison is not hidden
    behind float32 rounding; any other post-processing (a soft cap) keeps the model's logits.
    Raises `OracleError` when a decode step's cache did not grow by one token (it was dropped).
    """
    if not isinstance(reference, HfReference):
        kwargs = None if adapters is None else tuple({"adapter_names": [a]} for a in adapters)
        reference = HfReference(reference, kwargs)
    model = reference.model
    keyword = cache_keyword(model)
    head_out: list = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: head_out.append(output))
    try:
        out = []
        for r, prompt in enumerate(prompts):
            extra = {} if reference.request_kwargs is None else dict(reference.request_kwargs[r])
            res = model(prompt[None], use_cache=True, **extra)
            cache = returned_cache(res)
            # a cache that reports its length must hold the prompt now and one token more per step
            tracked = _cache_length(cache) == len(prompt)
            steps = [_logits(res, head_out)]
            for step, tokens in enumerate(decode_tokens, start=1):
                res = model(torch.tensor([[tokens[r]]]), use_cache=True, **{keyword: cache}, **extra)
                cache = returned_cache(res)
                if tracked and _cache_length(cache) != len(prompt) + step:
                    raise OracleError(
                        f"the reference's decode step {step} returned a cache of {_cache_length(cache)} tokens, not "
                        f"{len(prompt) + step}: it ran without the cache passed as `{keyword}=`"
                    )
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
