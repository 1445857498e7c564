"""LoRA through the boundaries on real gloo ranks vs Hugging Face + peft: several adapters and a
base-only request in one batch, at TP 1/2/4 and attention DP 2, with deferred and completed
LoRA sums equal."""

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary.cli.runner import run_rank

from lora_cases import DeferLoraSums, logits_of, lora_setup, rel_error

pytestmark = pytest.mark.gloo

TOLERANCE = 1e-10
CASES = {
    "tp1": (Topology(), {}),
    "tp2": (Topology(tp=2), {}),
    "tp4": (Topology(tp=4), {}),  # 2 KV heads replicated over 4 ranks: k/v LoRA B follows them
    # the FFN runs on both DP ranks' rows (MAX_LEN padded) and reduce-scatters the LoRA partial too
    "dp2": (Topology(tp=4, attn_dp=2), dict(reduction="rs", dp_padding="max_len")),
}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora-gloo-weights"))


def _run(gloo_world, job, topology, **kwargs):
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job, **kwargs)]
    return gloo_world(topology.world_size).run(run_rank, topology, job, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_adapters_match_peft(gloo_world, weights_dir, case):
    job, ref = lora_setup(weights_dir)
    topology, changes = CASES[case]
    results = _run(gloo_world, attrs.evolve(job, topology=topology, **changes), topology)
    assert rel_error(results, ref) < TOLERANCE


def test_deferred_and_completed_lora_sums_are_bitwise_equal(gloo_world, weights_dir):
    job, ref = lora_setup(weights_dir)
    topology = Topology(tp=2)
    job = attrs.evolve(job, topology=topology)
    deferred = _run(gloo_world, job, topology, fusions=DeferLoraSums(True))
    completed = _run(gloo_world, job, topology, fusions=DeferLoraSums(False))
    ours, theirs = logits_of(deferred), logits_of(completed)
    assert all(torch.equal(a, b) for r in ours for a, b in zip(ours[r], theirs[r]))
    assert rel_error(deferred, ref) < TOLERANCE
