"""The reference models' TBO path in the threaded world: cut requests, decode, attention DP."""

import attrs
import pytest
import torch

from layer_boundary import Topology
from layer_boundary_models import family, model_config
from layer_boundary.plugin import StepLayout
from layer_boundary_models.overlapped import step_rows
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary.testing.threaded import run_threaded


def test_step_rows_continues_a_cut_request_after_its_first_rows():
    step = StepLayout([7, 8, 9], [3, 4, 2], [10, 0, 5])
    first, second = step_rows(step, 0, 5), step_rows(step, 5, 9)
    assert (first.rids, first.counts, first.past) == ([7, 8], [3, 2], [10, 0])
    assert (second.rids, second.counts, second.past) == ([8, 9], [2, 2], [2, 5])
    assert torch.equal(torch.cat((first.positions, second.positions)), step.positions)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    out = {}
    for model in ("qwen3_moe", "longcat_flash"):
        path = tmp_path_factory.mktemp(model) / "w.pt"
        torch.save(family(model).random_weights(model_config(model), torch.float64, 5), path)
        out[model] = str(path)
    return out


@pytest.mark.parametrize("model", ["qwen3_moe", "longcat_flash"])
@pytest.mark.parametrize("topology", [Topology(tp=2), Topology(tp=4, attn_dp=2)], ids=["tp2", "dp2xtp2"])
def test_tbo_logits_match_the_whole_batch(weights, model, topology):
    config = model_config(model)
    prompts, decode = make_requests(config.vocab_size, 5, 6, 2, seed=4)  # lengths 5..7: prefill cuts a request
    job = RunJob(
        model=model, hf_config=dict(config.hf), topology=topology, reduction="rs+rsv", dtype="float64",
        weights=weights[model], prompts=prompts, decode_tokens=decode,
    )
    whole = run_threaded(run_rank, topology, job)
    overlapped = run_threaded(run_rank, topology, attrs.evolve(job, options={"tbo": True}))
    got, want = {}, {}
    for a, b in zip(overlapped, whole):
        got.update(a["logits"])
        want.update(b["logits"])
    assert sorted(got) == sorted(want) == list(range(5))
    # LongCat routes in fp32: a microbatch's router GEMM may round apart from the whole batch's
    tolerance = family(model).tolerances.get("float64", 1e-12)
    for r in want:
        for ours, theirs in zip(got[r], want[r]):
            assert (ours - theirs).abs().max().item() <= tolerance * theirs.abs().max().item(), r
    assert overlapped[0]["collectives"]["prefill"] != whole[0]["collectives"]["prefill"]  # it really split
