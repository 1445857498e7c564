"""The CuTe DSL kernels' dtype rule (bf16 and fp16, not fp32): a float16 qwen3_moe takes the fused
paths, a float32 one runs unfused, both matching the plugin off. The kernels are the references
restricted to the real kernels' dtypes."""

import dataclasses

import pytest
import torch

from layer_boundary_models import family, model_config
from layer_boundary import Parallel
from layer_boundary_cutedsl.kernels.tiling import SUPPORTED_DTYPES
from layer_boundary_cutedsl.testing import reference_kernels

from .decoder_driver import MOE_CONFIG, max_rel_diff, requests, run_decoder


@pytest.mark.parametrize("dtype, fused", [(torch.float16, True), (torch.float32, False)], ids=["fp16", "fp32"])
def test_the_kernels_take_float16_and_not_float32(dtype, fused):
    assert SUPPORTED_DTYPES == (torch.bfloat16, torch.float16)
    config = model_config("qwen3_moe", MOE_CONFIG)
    state = family("qwen3_moe").random_weights(config, dtype, seed=5)
    prompts, decode = requests(config)
    off, _, _ = run_decoder(Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=dtype)
    calls = []
    kernels = dataclasses.replace(reference_kernels(calls), dtypes=SUPPORTED_DTYPES)
    on, service, _ = run_decoder(Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=dtype, cutedsl={"kernels": kernels})
    launched = [c[0] for c in calls if c[0] != "prepare"]
    assert service.usable is fused and bool(launched) is fused
    assert max_rel_diff(on, off) < (1e-2 if dtype == torch.float16 else 1e-6)
