"""Shared set-up for the LoRA model tests: qwen3 weights, three adapters and a base-only
request in one batch, the peft reference (cached per process), and a test fusion provider."""

import functools

import torch

from layer_boundary.testing import logits_rel_error

from layer_boundary import FusedMlpInput, Topology, UnreducedOutput
from layer_boundary_models import family, model_config
from layer_boundary_models.lora_layers import random_lora_spec, random_lora_weights
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary_models.oracle import BASE_ADAPTER, hf_with_lora
from layer_boundary.cli.runner import RunJob, make_requests

ADAPTERS = 3
#: the adapter slot of each request (-1: the base model): four requests, four different routes
ASSIGNMENT = (0, 2, -1, 1)
LORA_SEED = 11
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@functools.lru_cache(maxsize=None)
def lora_setup(weights_dir: str, dtype: str = "float64"):
    """(job template, peft logits per request)."""
    config = model_config("qwen3")
    state = family("qwen3").random_weights(config, DTYPES[dtype], seed=7)
    path = f"{weights_dir}/qwen3-lora-{dtype}.pt"
    torch.save(state, path)
    prompts, decode = make_requests(config.vocab_size, len(ASSIGNMENT), 6, 3, seed=3)
    spec = random_lora_spec(ADAPTERS)
    hf = hf_with_lora(hf_from_state(dict(config.hf), state, DTYPES[dtype]), spec, random_lora_weights(config, spec, torch.float64, LORA_SEED))
    names = [BASE_ADAPTER if slot < 0 else spec.adapters[slot].name for slot in ASSIGNMENT]
    ref = hf_logits(hf, [torch.tensor(p) for p in prompts], decode, adapters=names)
    job = RunJob(
        model="qwen3", hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype=dtype,
        weights=path, prompts=prompts, decode_tokens=decode,
        options={"lora": ADAPTERS, "lora_seed": LORA_SEED, "lora_assignment": ASSIGNMENT},
    )
    return job, ref


def logits_of(results) -> dict:
    got = {}
    for res in results:
        got.update(res["logits"])
    return got


rel_error = logits_rel_error  # the same comparison as the core's model tests


class DeferLoraSums:
    """A fusion provider that accepts (or refuses) to let an FFN leave its sum to the next input,
    and a declining attention-input candidate that records each deferred sum arriving there."""

    def __init__(self, accept: bool):
        self.accept = accept
        self.asked = []
        self.arrived = []

    def can_defer_all_reduce(self, plan, forward):
        self.asked.append(plan.label)
        return self.accept

    def attention_input(self, plan):
        return (FusedMlpInput(run=self._watch, name="test.watch_deferred"),)

    def _watch(self, owed, residual, forward):
        if isinstance(owed, UnreducedOutput) and not owed.declared:
            self.arrived.append(owed.sum_group.name)
        return None  # decline before touching anything: the built-in completion runs
