"""Heterogeneous stacks: single-stage mixers, consecutive mixers and FFNs, and the neighbour rules.

A mixer leaves its attention-TP sum to the next stage always before an FFN and, per batch,
before another mixer only without attention DP; the next stage derives the same decision from
its own `previous`. Both neighbours must describe the same edge (checked at construction), and
a pipeline cut completes every sum exactly once (`to_pp` / `from_pp`).
"""

import attrs
import pytest
import torch

from layer_boundary import (
    CollectiveCounter,
    CountingCollectives,
    Forward,
    OwedOutput,
    ProducerReduction,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_attn_stage,
    make_stages,
    residual_batch,
)
from layer_boundary.cli.plan_cmd import PlanningCollectives
from layer_boundary.plugin import ExitRole, Owed
from layer_boundary import BatchVariant
from layer_boundary import Parallel
from layer_boundary.testing.grid import GridModel, GridSpec, grid_inputs, reference, run_grid_rank
from layer_boundary.testing.threaded import run_threaded

from grid_cases import assert_matches_reference

H = 4
MIXER = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)

#: Nemotron-H-like: consecutive mixers, mixer -> FFN, consecutive FFNs (dense and MoE), FFN -> mixer,
#: a PARTIAL attention between them, and a terminal mixer.
HETERO = GridSpec(stages=("mixer", "mixer", "ffn", "ffn", "mixer", "attn", "moe", "moe", "mixer"), seed=11)

TOPOLOGIES = {
    "tp1": (Topology(tp=1), (5,)),
    "tp2": (Topology(tp=2), (5,)),
    "tp4": (Topology(tp=4), (7,)),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), (5, 3)),
    "dp2xtp2-zero": (Topology(tp=4, attn_dp=2), (0, 4)),
    "dp2xtp1": (Topology(tp=2, attn_dp=2), (3, 2)),
    "tp4-ep2": (Topology(tp=4, moe_ep=2), (6,)),
}


def _norm():
    return RMSNorm(H, dtype=torch.float64)


def _counted(fn):
    """fn(parallel, ...) -> (result, collectives this rank issued)."""

    def run(parallel, *args, **kwargs):
        counter = CollectiveCounter()
        out = fn(parallel.with_groups(lambda g: CountingCollectives(g, counter)), *args, **kwargs)
        return out, counter.snapshot()

    return run


# --- a heterogeneous stack is exact in every topology ------------------------------------------


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_heterogeneous_stack_matches_a_single_rank(topo):
    topology, counts = TOPOLOGIES[topo]
    results = run_threaded(run_grid_rank, topology, HETERO, counts, captures=(0, 4))
    assert_matches_reference(results, HETERO, topology, counts, captures=(0, 4))


@pytest.mark.parametrize(
    "topo, expected",
    [
        # mixer->mixer deferred, mixer->ffn declared, ffn->ffn and ffn->mixer deferred, mixer->attn
        # deferred, attn->moe declared, moe->moe and moe->mixer deferred, terminal mixer reduces
        ("tp2", {"all_reduce@attn_tp": 5, "all_reduce@tp": 4}),
        # attention DP: the mixer before a mixer reduces inside its compute (never deferred); a sum
        # left before an FFN completes together with the DP gather (all_reduce@tp over full rows)
        ("dp2xtp2", {"all_gatherv@attn_dp": 2, "all_reduce@attn_tp": 3, "all_reduce@tp": 6}),
    ],
)
def test_every_stage_output_is_summed_exactly_once(topo, expected):
    topology, counts = TOPOLOGIES[topo]
    results = run_threaded(_counted(run_grid_rank), topology, HETERO, counts, policy="ar")
    for (out, _), snapshot in results:
        assert snapshot == expected
    assert_matches_reference([r[0] for r in results], HETERO, topology, counts)


# --- the mixer's per-batch decision and the next stage's matching expectation ---------------


def _mixer_then(parallel, following, n, *, terminal=False):
    """A mixer followed by `following`: what its exit decided and what it recorded."""
    mixer = make_attn_stage(attrs.evolve(MIXER, following=following, terminal=terminal), _norm(), parallel=parallel, reduction="ar")
    counts = (n,) * parallel.attn_dp
    fwd = Forward(parallel, n, dp_counts=counts)
    residual_batch.start(fwd)
    x = mixer.prepare(torch.ones(n, H, dtype=torch.float64), fwd)
    with mixer.exit(fwd) as out:
        skips = out.skips_reduction
    handle = out.finish(x * 0.5 if skips else parallel.groups["attn_tp"].all_reduce(x * 0.5))
    pending = fwd.residual_stream.pending
    owed = pending.owed if pending is not None else None
    if isinstance(handle, OwedOutput):
        kind = "declared" if owed.declared else "deferred"
    else:
        kind = "complete"
    return skips, kind


@pytest.mark.parametrize(
    "topology, n, following, expected",
    [
        (Topology(tp=2), 4, "mixer", (True, "deferred")),  # defer to the next mixer's input
        (Topology(tp=2), 0, "mixer", (False, "complete")),  # an empty batch never defers
        (Topology(tp=4, attn_dp=2), 3, "mixer", (False, "complete")),  # never under attention DP
        (Topology(tp=2, attn_dp=2), 3, "mixer", (False, "complete")),  # attention TP of one: nothing to sum
        (Topology(tp=2), 4, "attn", (True, "deferred")),  # a PARTIAL attention is a mixer neighbour too
        (Topology(tp=2), 4, "ffn", (True, "declared")),  # before an FFN: always left, declared
        (Topology(tp=2), 0, "ffn", (True, "declared")),
        (Topology(tp=4, attn_dp=2), 3, "ffn", (True, "declared")),  # including under attention DP
        (Topology(tp=2), 4, "terminal", (False, "complete")),  # the last stage leaves nothing
    ],
)
def test_mixer_leaves_or_defers_its_sum_per_batch(topology, n, following, expected):
    nxt = {"mixer": MIXER, "attn": declare_attn(), "ffn": declare_ffn(), "terminal": None}[following]
    results = run_threaded(lambda p: _mixer_then(p, nxt, n, terminal=following == "terminal"), topology)
    assert all(r == expected for r in results), results


KINDS = {
    "mixer": MIXER,
    "attn": declare_attn(),
    "ffn": declare_ffn(),
    "moe": declare_ffn(sparse=True),
    "tail": declare_ffn(reduction=ProducerReduction.LOCAL_TAIL),
}


@pytest.mark.parametrize("topology", [Topology(tp=2), Topology(tp=4, attn_dp=2), Topology(tp=2, attn_dp=2), Topology(tp=1)])
@pytest.mark.parametrize("producer", ["mixer", "attn", "ffn", "moe", "tail"])
@pytest.mark.parametrize("consumer", ["mixer", "attn", "ffn", "moe"])
def test_both_neighbours_derive_the_same_decision(topology, producer, consumer):
    """What the producer's exit may leave is exactly what the consumer's entry expects."""
    parallel = Parallel.create(topology, 0, lambda name, ranks: PlanningCollectives(name, ranks, 0))
    with layer_stack(parallel, reduction="ar"):
        first = make_stages((KINDS[producer], _norm()), following=KINDS[consumer])[0]
        second = make_stages((KINDS[consumer], _norm()), previous=KINDS[producer], terminal=True)[0]
    exit_path = first.plan.paths[BatchVariant.ORDINARY].exit
    entry = second.plan.paths[BatchVariant.ORDINARY].entry
    leaves_declared = exit_path.role is ExitRole.DECLARED or exit_path.leaves_declared
    assert (entry.owed is Owed.DECLARED) is leaves_declared
    if exit_path.may_defer:  # whatever the producer may defer, the consumer is ready to complete
        assert entry.owed is Owed.DYNAMIC
    if producer == "tail" or topology.attn_dp > 1:  # nothing is deferred across this edge
        assert not exit_path.may_defer and entry.owed in (Owed.NOTHING, Owed.DECLARED)


# --- inconsistent neighbours are rejected at construction ------------------------------------


def test_a_mixer_following_an_ffn_cannot_be_followed_by_a_mixer():
    p = Parallel.single()
    with layer_stack(p, reduction="ar"):
        make_stages((MIXER, _norm()), following=declare_ffn())
        with pytest.raises(ValueError, match=r"declared following=ffn, but this call starts with mixer"):
            make_stages((MIXER, _norm()), previous=MIXER, terminal=True)


def test_a_stage_after_a_mixer_must_name_a_mixer_as_previous():
    p = Parallel.single()
    with layer_stack(p, reduction="ar"):
        make_stages((MIXER, _norm()), following=MIXER)
        with pytest.raises(ValueError, match=r"previous=ffn does not describe the stage built before it \(mixer\)"):
            make_stages((MIXER, _norm()), previous=declare_ffn(), terminal=True)


def test_consecutive_ffns_must_agree_on_sparsity():
    p = Parallel.single()
    with layer_stack(p, reduction="ar"):
        make_stages((declare_ffn(sparse=True), _norm()), following=declare_ffn())
        with pytest.raises(ValueError, match=r"previous=ffn does not describe the stage built before it \(ffn\[sparse\]\)"):
            make_stages((declare_ffn(), _norm()), previous=declare_ffn(), terminal=True)


def test_neighbour_declarations_that_name_their_own_neighbour_must_name_this_stage():
    p = Parallel.single()
    wrong_following = attrs.evolve(MIXER, previous=declare_ffn())
    with pytest.raises(ValueError, match=r"following=mixer names a previous stage \(ffn\) that is not this mixer stage"):
        make_stages((MIXER, _norm()), following=wrong_following, parallel=p)
    wrong_previous = attrs.evolve(declare_ffn(), following=declare_attn())
    with pytest.raises(ValueError, match=r"previous=ffn names a following stage \(attention\) that is not this mixer stage"):
        make_stages((MIXER, _norm()), previous=wrong_previous, following=MIXER, parallel=p)
    # described consistently, the same edge is accepted from either side
    make_stages((MIXER, _norm()), previous=attrs.evolve(declare_ffn(), following=MIXER), following=attrs.evolve(MIXER, previous=MIXER), parallel=p)


def test_a_non_terminal_mixer_needs_following_and_a_terminal_one_refuses_it():
    p = Parallel.single()
    with pytest.raises(ValueError, match="needs following="):
        make_stages((MIXER, _norm()), previous=MIXER, parallel=p)
    with pytest.raises(ValueError, match="a terminal stage has no following stage"):
        make_stages((MIXER, _norm()), previous=MIXER, following=MIXER, terminal=True, parallel=p)


# --- pipeline cuts ----------------------------------------------------------------------------


@pytest.mark.parametrize("topo", ["tp2", "tp4", "dp2xtp2"])
@pytest.mark.parametrize(
    "split", [1, 2, 4, 8], ids=["mixer|mixer", "mixer|ffn", "ffn|mixer", "moe|mixer"]
)
def test_a_pipeline_cut_completes_every_sum_exactly_once(topo, split):
    topology, counts = TOPOLOGIES[topo]
    whole = run_threaded(_counted(run_grid_rank), topology, HETERO, counts)
    cut = run_threaded(_counted(run_grid_rank), topology, HETERO, counts, split=split)
    assert_matches_reference([r[0] for r in cut], HETERO, topology, counts)
    for (_, one), (_, two) in zip(whole, cut):
        sums = lambda snap: {k: v for k, v in snap.items() if k.startswith("all_reduce") or k.startswith("reduce_scatter")}  # noqa: E731
        assert sums(two) == sums(one), (one, two)


def _cut_run(parallel, sender_spec, receiver_spec, split, *, edit=None, sender_terminal=False):
    """Run a grid split at `split`, letting `edit` change the handed-off tensors; the sender's
    last stage may be built terminal (a common mistake at a pipeline cut)."""
    counts = (5,)
    x = grid_inputs(HETERO, counts)[0]
    first = GridModel(sender_spec, parallel, segment=(0, split))
    if sender_terminal:
        last = first.boundaries[-1]
        decl = attrs.evolve(last.declaration, previous=None, following=None, terminal=False)
        (first.boundaries[-1],) = make_stages(
            (decl, first.stages[-1].norm), previous=last.declaration.previous, terminal=True, parallel=parallel, reduction="ar"
        )
    second = GridModel(receiver_spec, parallel, segment=(split, len(receiver_spec.stages)))
    fwd = Forward(parallel, x.shape[0])
    tensors = first.run(x, fwd)
    if edit is not None:
        tensors = edit(tensors)
    fwd2 = Forward(parallel, x.shape[0])
    h = second.boundaries[0].from_pp(tensors, fwd2)
    return second.run(h, fwd2)


def test_a_sender_that_completed_its_declared_sum_is_not_summed_again():
    """The mixer before an FFN ends the sender's segment marked terminal by mistake: it reduces
    itself, and the receiver (expecting the declared partial) must not reduce it again."""
    split = 2  # mixer | ffn
    ref = reference(HETERO, grid_inputs(HETERO, (5,)))[0][0]
    good = run_threaded(lambda p: _cut_run(p, HETERO, HETERO, split, sender_terminal=True), Topology(tp=2))
    assert all(torch.equal(out, ref) for out in good)
    # without the flag the receiver trusts its own contract and sums the complete output again
    drop = lambda t: {k: v for k, v in t.items() if k != "owes_declared_sum"}  # noqa: E731
    doubled = run_threaded(lambda p: _cut_run(p, HETERO, HETERO, split, sender_terminal=True, edit=drop), Topology(tp=2))
    assert not torch.equal(doubled[0], ref)


def test_preserve_declared_false_hands_off_a_complete_output():
    def run(parallel):
        counts = (5,)
        x = grid_inputs(HETERO, counts)[0]
        first = GridModel(HETERO, parallel, segment=(0, 2))
        second = GridModel(HETERO, parallel, segment=(2, len(HETERO.stages)))
        fwd = Forward(parallel, 5)
        residual_batch.start(fwd)
        h = x
        for stage, boundary in zip(first.stages, first.boundaries):
            y = boundary.prepare(h, fwd)
            with boundary.exit(fwd) as out:
                y = stage.compute(y)
            h = out.finish(y)
        tensors = residual_batch.to_pp(h, fwd, preserve_declared=False)
        assert tensors["owes_declared_sum"] is False
        fwd2 = Forward(parallel, 5)
        return second.run(second.boundaries[0].from_pp(tensors, fwd2), fwd2)

    ref = reference(HETERO, grid_inputs(HETERO, (5,)))[0][0]
    assert all(torch.equal(out, ref) for out in run_threaded(run, Topology(tp=2)))


def test_a_partial_handed_to_a_stage_expecting_a_complete_output_is_refused():
    """The sender's mixer was built with following=FFN (it leaves its sum declared) but the
    receiving rank starts with a mixer: the partial would be taken as complete."""
    wrong = GridSpec(stages=("mixer", "mixer", "mixer") + HETERO.stages[3:], seed=HETERO.seed)

    def run(parallel):
        with pytest.raises(ValueError, match=r"expects a complete output; describe the same edge on both pipeline ranks"):
            _cut_run(parallel, HETERO, wrong, 2)
        return True

    assert all(run_threaded(run, Topology(tp=2)))


def test_to_pp_reports_what_it_hands_off():
    def run(parallel):
        seen = {}
        for split in (1, 2, 4):
            first = GridModel(HETERO, parallel, segment=(0, split))
            fwd = Forward(parallel, 5)
            tensors = first.run(grid_inputs(HETERO, (5,))[0], fwd)
            seen[split] = tensors["owes_declared_sum"]
        return seen

    tp2 = run_threaded(run, Topology(tp=2))[0]
    assert tp2 == {1: False, 2: True, 4: False}  # only the mixer before an FFN hands off a partial
    single = run(Parallel.single())
    assert single == {1: False, 2: False, 4: False}  # one rank: nothing is ever owed


def test_a_handed_off_partial_is_this_ranks_share():
    """The partial to_pp hands off is this rank's share: summing the shares gives the output."""

    def run(parallel):
        first = GridModel(HETERO, parallel, segment=(0, 2))
        fwd = Forward(parallel, 5)
        return first.run(grid_inputs(HETERO, (5,))[0], fwd)["hidden_states"]

    shares = run_threaded(run, Topology(tp=2))
    whole = run(Parallel.single())
    assert torch.equal(shares[0] + shares[1], whole)
