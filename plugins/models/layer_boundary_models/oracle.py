"""The Hugging Face references of the reference families (`ModelFamily.reference`).

The command line builds the Hugging Face causal LM of a config with eager attention and eager
experts (`ReferenceRequest.hf_model`); a family adjusts that: Nemotron-H's batched experts, the
refusal of an option no Hugging Face model has, and for LoRA runs `peft` (pinned) wrapping it
with the same adapters, each request routed to its own adapter.

Where the supported transformers releases compute a family differently, the reference is made
to compute what the family implements, detected from the built model (never from a version
string): LongCat-Flash's expert weights in either layout, Nemotron-H's dt floor in the chunked
scan and its RMSNorm's float32 weight product; where it cannot be (Nemotron-H's float32 scan
summed in another order), the reference says how exact it is (`HfReference.tolerance`).
"""

from __future__ import annotations

import copy
import os
import types

import torch

from layer_boundary.plugin import HfReference, ReferenceRequest

from .config import FINAL_NORM_KEY, ConfigError

__all__ = ["reference", "hf_with_lora", "require_peft", "HF_BUILD_OPTIONS", "BASE_ADAPTER"]

#: peft's name for "no adapter" in a mixed batch
BASE_ADAPTER = "__base__"

#: per model_type `from_config` options replacing the eager defaults
HF_BUILD_OPTIONS = {
    # Hugging Face's eager experts accumulate the routed sum in float32 even in a float64 model,
    # which no sharded sum can reproduce bit for bit; its batched experts do not
    "nemotron_h": {"experts_implementation": "batched_mm"},
}


def reference(request: ReferenceRequest) -> HfReference:
    """The Hugging Face model a reference family's run is checked against."""
    hf = dict(request.config.hf)
    if hf.get(FINAL_NORM_KEY, "default") != "default":
        raise ConfigError(
            f"{FINAL_NORM_KEY}={hf[FINAL_NORM_KEY]!r} is a reference-model option no Hugging Face model has; "
            "check against a single rank (--check single) instead"
        )
    model_type = request.config.model_type
    fit = _FIT_STATE.get(model_type)
    model = request.hf_model(fit_state=fit and fit(request.config), **HF_BUILD_OPTIONS.get(model_type, {}))
    tolerance = _ALIGN[model_type](model, request.config) if model_type in _ALIGN else None
    count = int(request.options.get("lora") or 0)
    if not count:
        return HfReference(model, tolerance=tolerance)
    from .lora_layers import random_lora_spec, random_lora_weights, request_adapters

    spec = random_lora_spec(count)
    weights = random_lora_weights(request.config, spec, torch.float64, int(request.options.get("lora_seed", 0)))
    slots = request_adapters(request.requests, count, request.options.get("lora_assignment"))
    names = tuple({"adapter_names": [spec.adapters[s].name if s >= 0 else BASE_ADAPTER]} for s in slots)
    return HfReference(hf_with_lora(model, spec, weights), names, tolerance)


def _fit_longcat_experts(config):
    """transformers up to 5.24 keeps `experts.gate_up_proj` rows for the zero-compute experts
    too (never used; the family's random weights draw them), later releases only for the routed
    experts: give the built model the rows it holds."""
    routed, total = config.num_experts, config.num_experts + config.zero_experts

    def fit(state, model):
        held = model.state_dict()
        fitted = dict(state)
        for name, tensor in state.items():
            if name.endswith("mlp.experts.gate_up_proj") and name in held and held[name].shape[0] == routed < total == tensor.shape[0]:
                fitted[name] = tensor[:routed]
        return fitted

    return fit


def _pin_nemotron_dt_floor(model, config) -> None:
    """Our Mamba-2 mixer floors dt at `time_step_min` in the chunked (prefill) scan and not in the
    recurrent step, as transformers up to 5.24 hard-codes; later releases take the floor from
    `config.time_step_limit` (default: none). Every mixer gets the same floor, so each release
    checks the same arithmetic."""
    for module in model.modules():
        if hasattr(module, "time_step_limit") and hasattr(module, "dt_bias"):
            module.time_step_limit = (config.time_step_min, float("inf"))


def _float32_weight_product(self, hidden_states):
    dtype = hidden_states.dtype
    hidden = hidden_states.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.to(torch.float32) * hidden).to(dtype)


def _multiplies_in_input_dtype(norm) -> bool:
    """Whether a Nemotron-H RMSNorm multiplies its weight in the input's dtype (transformers
    before 5.18) instead of in float32 as NVIDIA's reference does: probed in float64 with a
    weight float32 cannot hold."""
    probe = copy.deepcopy(norm).to(torch.float64)
    with torch.no_grad():
        probe.weight.fill_(1 / 3)
    x = torch.linspace(0.5, 1.5, probe.weight.numel(), dtype=torch.float64)[None]
    with torch.no_grad():
        got = probe(x)
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + probe.variance_epsilon)
        in_input_dtype = probe.weight * normed.to(torch.float64)
    return torch.equal(got, in_input_dtype) and not torch.equal(got, _float32_weight_product(probe, x))


#: Nemotron-H's float64 tolerance against a release whose chunked scan is not ours bit for bit:
#: the scan runs in float32, so its sums in another order differ by float32 rounding (measured
#: 2.4e-7 relative at TP 2 against transformers 5.17)
SCAN_REORDERED_TOLERANCE = 1e-6


def _scan_reproduced(model) -> bool:
    """Whether the installed Nemotron-H chunked scan (`mamba2_chunk_scan` of the model's module,
    float32 inside) gives our `chunked_scan`'s bits; releases before 5.18 sum its products in
    another order. Probed on two chunks, one of them padded, from a carried state."""
    import sys

    from .mamba import chunked_scan

    hf_scan = getattr(sys.modules[type(model).__module__], "mamba2_chunk_scan", None)
    if hf_scan is None:
        return False
    gen = torch.Generator().manual_seed(0)
    dtype, (b, t, h, p, g, n) = torch.float64, (1, 7, 4, 3, 2, 5)
    x, B, C = (torch.randn(*shape, generator=gen, dtype=dtype) for shape in ((b, t, h, p), (b, t, g, n), (b, t, g, n)))
    dt, initial = torch.randn(b, t, h, generator=gen, dtype=dtype), torch.randn(b, h, p, n, generator=gen)
    A, D, dt_bias = -torch.rand(h, generator=gen).exp(), torch.randn(h, generator=gen, dtype=dtype), torch.randn(h, generator=gen, dtype=dtype)
    try:
        theirs = hf_scan(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias, initial_states=initial, dt_softplus=True,
                         dt_limit=(1e-3, float("inf")), return_final_states=True)
    except Exception:  # a kernel that does not run here, or another signature: not ours either way
        return False
    ours = chunked_scan(x, dt, A, B, C, chunk=4, D=D, dt_bias=dt_bias, dt_min=1e-3, initial=initial)
    return all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _align_nemotron_h(model, config):
    """The reference computing what the family does; its tolerance where it cannot exactly."""
    _pin_nemotron_dt_floor(model, config)
    norms = [m for m in model.modules() if type(m).__name__ == "NemotronHRMSNorm"]
    if norms and _multiplies_in_input_dtype(norms[0]):
        for norm in norms:
            norm.forward = types.MethodType(_float32_weight_product, norm)
    return None if _scan_reproduced(model) else SCAN_REORDERED_TOLERANCE


#: per model_type: what makes `ReferenceRequest.hf_model`'s `fit_state` of the config, and a
#: change to the built model (before any adapter wraps it) returning the reference's tolerance
_FIT_STATE = {"longcat_flash": _fit_longcat_experts}
_ALIGN = {"nemotron_h": _align_nemotron_h}


def require_peft():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import peft
    except ImportError:
        raise ConfigError("--lora with --check hf needs peft: pip install 'layer-boundary-models[oracle]'") from None
    return peft


def hf_with_lora(model, spec, weights) -> "object":
    """`model` wrapped by peft with every adapter of `spec` (a `LoraSpec`) holding exactly the
    tensors of `weights` (`lora_layers.weight_name` names; every one is used, none missing)."""
    peft = require_peft()
    from peft.tuners.lora import LoraLayer

    wrapped = None
    for adapter in spec.adapters:
        config = peft.LoraConfig(
            r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none"
        )
        if wrapped is None:
            wrapped = peft.get_peft_model(model, config, adapter_name=adapter.name)
        else:
            wrapped.add_adapter(adapter.name, config)
    unused = set(weights)
    with torch.no_grad():
        for name, module in wrapped.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            key = name.removeprefix("base_model.model.")
            for adapter in spec.adapters:
                for part, store in (("A", module.lora_A), ("B", module.lora_B)):
                    tensor_name = f"{key}.lora_{part}.{adapter.name}.weight"
                    target = store[adapter.name].weight
                    target.copy_(weights[tensor_name].to(target.dtype))
                    unused.discard(tensor_name)
    if unused:
        raise ValueError(f"{len(unused)} LoRA tensors found no peft module, e.g. {sorted(unused)[0]}")
    return wrapped.eval()
