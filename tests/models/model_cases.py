"""Shared setup for the model tests: weights, HF reference logits, jobs (cached per process)."""

import functools

import torch

from layer_boundary.testing import logits_rel_error

from layer_boundary import Topology
from layer_boundary_models import model_config
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary.cli.runner import RunJob, make_requests
from layer_boundary_models import family

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


@functools.lru_cache(maxsize=None)
def setup(model: str, dtype: str, weights_dir: str, batch: int = 4, prompt: int = 6, steps: int = 3):
    """(job template, HF logits per request) for a model; weights saved under weights_dir."""
    config = model_config(model)
    state = family(model).random_weights(config, DTYPES[dtype], seed=7)
    path = f"{weights_dir}/{model}-{dtype}.pt"
    torch.save(state, path)
    prompts, decode = make_requests(config.vocab_size, batch, prompt, steps, seed=3)
    hf = hf_from_state(dict(config.hf), state, DTYPES[dtype])
    ref = hf_logits(hf, [torch.tensor(p) for p in prompts], decode)
    job = RunJob(
        model=model, hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype=dtype,
        weights=path, prompts=prompts, decode_tokens=decode,
    )
    return job, ref


rel_error = logits_rel_error  # shared with the plugins' model tests
