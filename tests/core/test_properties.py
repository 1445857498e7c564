"""Property tests: random topology, stack, token counts, policy, variant and pipeline cut, all
bit-exact against a single rank in the threaded world (float64, grid arithmetic).

Profiles: `HYPOTHESIS_PROFILE=ci` (default: 500 examples, derandomized) or `dev` (5000).
"""

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from layer_boundary import FusedMlpInput, Topology
from layer_boundary.plugin import add_rms_norm
from layer_boundary.testing.grid import GridSpec, run_grid_rank
from layer_boundary.testing.threaded import run_threaded

from grid_cases import assert_matches_reference

CODES = ("attn", "ffn", "moe", "mixer", "tail")


class FinalizeService:
    """Defers MoE finalizes (terminal included) and completes them in torch, in the grid norm's
    exact op order (a stand-in for a fused finalize kernel)."""

    def can_defer_finalize(self, plan, fwd):
        return plan.description.sparse

    def attention_input(self, plan):
        norm = plan.norm
        return (FusedMlpInput(run=lambda h, r, fwd: add_rms_norm(norm, h.complete(), r), handoff=True, name="test.finalize"),)

    def finalize(self, handoff, residual, gamma):
        total = handoff.complete() + residual
        return gamma * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)), total


@st.composite
def scenarios(draw):
    attn_dp = draw(st.sampled_from((1, 2, 4)))
    attn_tp = draw(st.sampled_from((1, 2, 4) if attn_dp < 4 else (1, 2)))
    tp = attn_dp * attn_tp
    moe_ep = draw(st.sampled_from([e for e in (1, 2, 4) if tp % e == 0]))
    stages = tuple(draw(st.lists(st.sampled_from(CODES), min_size=1, max_size=6)))
    transforms = tuple(sorted(draw(st.sets(st.integers(0, len(stages) - 1), max_size=2))))
    counts = tuple(draw(st.integers(0, 5)) for _ in range(attn_dp))
    policy = draw(st.sampled_from(("ar", "rs", "rsv", "rs+rsv")))
    padding = draw(st.sampled_from(("sum_len", "max_len")))
    variant = draw(st.sampled_from((None, "sp", "is"))) if attn_dp == 1 and attn_tp > 1 else None
    split = draw(st.one_of(st.none(), st.integers(1, len(stages) - 1))) if len(stages) > 1 else None
    mode = draw(st.sampled_from(("extend", "decode")))
    handoff = draw(st.booleans()) and "moe" in stages
    seed = draw(st.integers(0, 3))
    return dict(
        topology=Topology(tp=tp, attn_dp=attn_dp, moe_ep=moe_ep),
        spec=GridSpec(stages=stages, transforms=transforms, seed=seed),
        counts=counts,
        kwargs=dict(policy=policy, padding=padding, variant=variant, split=split, mode=mode),
        handoff=handoff,
    )


@given(scenarios())
def test_any_stack_on_any_topology_matches_a_single_rank(case):
    note(repr(case))
    topology, spec, counts = case["topology"], case["spec"], case["counts"]

    def rank(parallel):
        service = FinalizeService() if case["handoff"] else None
        return run_grid_rank(parallel, spec, counts, fusions=service, handoff_norm=service, **case["kwargs"])

    results = run_threaded(rank, topology)
    assert_matches_reference(results, spec, topology, counts)
