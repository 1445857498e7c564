"""The LoRA reference decoder in the threaded world: peft parity on every row layout, and
deferred LoRA sums (threads share the test provider, so the deferral itself is observed)."""

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary.cli.runner import run_rank
from layer_boundary.testing.threaded import run_threaded

from lora_cases import DeferLoraSums, logits_of, lora_setup, rel_error

TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora-weights"))


@pytest.mark.parametrize(
    "topology, changes",
    [
        (Topology(tp=2), dict(sequence_parallel=True, reduction="rsv")),
        (Topology(tp=4, attn_dp=2), dict(reduction="rsv", dp_padding="sum_len")),
        (Topology(tp=2, attn_dp=2), dict(reduction="ar", dp_padding="max_len")),
    ],
    ids=["sp-tp2", "dp2-attn_tp2-sum_len", "dp2-attn_tp1-max_len"],
)
def test_mixed_adapters_match_peft_on_every_row_layout(weights_dir, topology, changes):
    job, ref = lora_setup(weights_dir)
    results = run_threaded(run_rank, topology, attrs.evolve(job, topology=topology, **changes))
    assert rel_error(results, ref) < TOLERANCE


@pytest.mark.oracle
def test_a_request_on_the_wrong_adapter_is_caught(weights_dir):
    """The check is sensitive to routing: one request moved to another adapter fails it."""
    job, ref = lora_setup(weights_dir)
    assert rel_error([run_rank(Parallel.single(), job)], ref) < TOLERANCE
    wrong = attrs.evolve(job, options={**job.options, "lora_assignment": (0, 2, -1, 0)})
    assert rel_error([run_rank(Parallel.single(), wrong)], ref) > 1e-3


def _deferral(job, accept):
    provider = DeferLoraSums(accept)
    results = run_threaded(run_rank, Topology(tp=2), attrs.evolve(job, topology=Topology(tp=2)), fusions=provider)
    return provider, results


def test_a_lora_ffn_defers_its_sum_only_when_a_provider_accepts_and_both_paths_agree_bitwise(weights_dir):
    job, ref = lora_setup(weights_dir)
    deferring, deferred = _deferral(job, True)
    refusing, completed = _deferral(job, False)
    # 4 layers: the first 3 FFNs may defer (the last is terminal); 4 steps (prefill + 3 decode); 2 ranks
    assert len(deferring.asked) == len(refusing.asked) == 3 * 4 * 2
    assert deferring.arrived == ["TP"] * (3 * 4 * 2)  # each deferred sum reached the next attention input
    assert refusing.arrived == []
    ours, theirs = logits_of(deferred), logits_of(completed)
    assert all(torch.equal(a, b) for r in ours for a, b in zip(ours[r], theirs[r]))
    assert rel_error(deferred, ref) < TOLERANCE


def test_without_lora_the_ffn_defers_without_asking(weights_dir):
    job, _ = lora_setup(weights_dir)
    plain = attrs.evolve(job, options={})
    provider, _ = _deferral(plain, False)
    assert provider.asked == [] and len(provider.arrived) == 3 * 4 * 2


def test_gathered_adapter_ids_cost_one_collective_per_forward(weights_dir):
    job, _ = lora_setup(weights_dir)
    topology = Topology(tp=4, attn_dp=2)
    lora = attrs.evolve(job, topology=topology, reduction="rsv")
    with_lora = run_threaded(run_rank, topology, lora)[0]["collectives"]
    without = run_threaded(run_rank, topology, attrs.evolve(lora, options={}))[0]["collectives"]
    for step, counts in with_lora.items():
        extra = {k: v - without[step].get(k, 0) for k, v in counts.items() if v != without[step].get(k, 0)}
        assert extra == {"all_gatherv@attn_dp": 1}, (step, counts, without[step])
