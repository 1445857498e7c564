"""The parallel residual, `declare_ffn(parallel_residual=True)`: `h + attn(n1(h)) + mlp(n2(h))`
with the attention's and the FFN's partial outputs joined into one owed sum.

The grid's "pffn" stage is such an FFN: bit-exact against a single rank in every topology and
batch variant, and the single rank against the layer written by hand; the collectives a layer
issues (one all-reduce where attention TP is TP; under attention DP no attention-TP sum at all);
a fused consumer takes the joined sum like any deferred one; wrong combinations fail at
construction naming the stage; misuse at run time fails before anything is summed.
"""

import attrs
import pytest
import torch

from layer_boundary import (
    Forward,
    FusedMlpInput,
    OutputTransform,
    Parallel,
    ProducerReduction,
    RMSNorm,
    SumGroup,
    Topology,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
    residual_batch,
)
from layer_boundary.cli.plan_cmd import PlanningCollectives
from layer_boundary.plugin import add_rms_norm
from layer_boundary.testing.grid import GridModel, GridSpec, grid_inputs, reference, run_grid_rank
from layer_boundary.testing.threaded import run_threaded
from layer_boundary.testing import requires_plugins

from grid_cases import assert_matches_reference, counted_grid_rank

H = 4

#: parallel layers around a sequential one, ending with a terminal parallel FFN
PARALLEL = GridSpec(stages=("attn", "pffn", "attn", "pffn", "attn", "ffn", "attn", "pffn"), paired=True, seed=3)
#: the same stages, each built by its own make_stages call (the attention with following=, the FFN with previous=)
UNPAIRED = attrs.evolve(PARALLEL, paired=False)
#: three parallel layers and nothing else, for counting what a layer issues
LAYERS = GridSpec(stages=("attn", "pffn") * 3, paired=True, seed=4)
SEQUENTIAL = attrs.evolve(LAYERS, stages=("attn", "ffn") * 3)


def _norm():
    return RMSNorm(H, dtype=torch.float64, compute_dtype=torch.float64)


def _planning(topology: Topology, rank: int = 0) -> Parallel:
    return Parallel.create(topology, rank, lambda name, ranks: PlanningCollectives(name, ranks, rank))


# --- values --------------------------------------------------------------------------------------


@torch.inference_mode()
def test_one_rank_is_the_layer_written_by_hand():
    """The reference the topologies are compared with is the parallel residual itself."""
    model = GridModel(PARALLEL, Parallel.single())
    s = model.stages
    for x, got in zip(grid_inputs(PARALLEL, (5, 3)), reference(PARALLEL, grid_inputs(PARALLEL, (5, 3)))[0]):
        h = x
        for attn, ffn in ((s[0], s[1]), (s[2], s[3])):
            h = h + attn.compute(attn.norm(h)) + ffn.compute(ffn.norm(h))
        h = h + s[4].compute(s[4].norm(h))
        h = h + s[5].compute(s[5].norm(h))
        h = h + s[6].compute(s[6].norm(h)) + s[7].compute(s[7].norm(h))
        assert torch.equal(model.final_norm(h), got)


CASES = {
    "tp2": (Topology(tp=2), (5,), {}),
    "tp4": (Topology(tp=4), (7,), {}),
    "tp4-decode": (Topology(tp=4), (3,), dict(mode="decode")),
    "tp4-sp-rs+rsv": (Topology(tp=4), (7,), dict(variant="sp", policy="rs+rsv")),
    "tp4-sp-ar": (Topology(tp=4), (7,), dict(variant="sp")),
    "tp2-is": (Topology(tp=2), (6,), dict(variant="is", policy="rsv")),
    "dp2xtp2-ar": (Topology(tp=4, attn_dp=2), (5, 3), {}),
    "dp2xtp2-rs+rsv": (Topology(tp=4, attn_dp=2), (5, 3), dict(policy="rs+rsv")),
    "dp2xtp2-rs-max_len": (Topology(tp=4, attn_dp=2), (5, 2), dict(policy="rs", padding="max_len")),
    "dp2xtp1-zero-rows": (Topology(tp=2, attn_dp=2), (0, 3), dict(policy="rsv")),
    "tp2-pp-cut": (Topology(tp=2), (5,), dict(split=4)),
    "dp2xtp2-pp-cut": (Topology(tp=4, attn_dp=2), (4, 3), dict(split=2, policy="rs+rsv")),
    "tp2-captures": (Topology(tp=2), (5,), dict(captures=(2, 6))),
}


@pytest.mark.parametrize("spec", [PARALLEL, UNPAIRED], ids=["paired", "unpaired"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_a_single_rank(case, spec):
    topology, counts, kwargs = CASES[case]
    results = run_threaded(run_grid_rank, topology, spec, counts, **kwargs)
    assert_matches_reference(results, spec, topology, counts, captures=kwargs.get("captures", ()))


# --- what a layer issues -------------------------------------------------------------------------

#: (topology, dp counts, run options, what each rank issues over the three layers of LAYERS)
COUNTS = {
    # attention TP = TP: the one joined sum a layer (the last one all-reduced at its terminal exit)
    "tp2": (Topology(tp=2), (5,), {}, {"all_reduce@tp": 3}),
    "tp4-decode": (Topology(tp=4), (2,), dict(mode="decode"), {"all_reduce@tp": 3}),
    # attention DP: no attention-TP sum; the TP sum over the gathered rows completes both
    "dp2xtp2-ar": (Topology(tp=4, attn_dp=2), (5, 3), {}, {"all_gatherv@attn_dp": 3, "all_reduce@tp": 3}),
    "dp2xtp2-rs+rsv": (Topology(tp=4, attn_dp=2), (5, 3), dict(policy="rs+rsv"),
                       {"all_gatherv@attn_dp": 3, "reduce_scatterv@tp": 3, "all_gatherv@attn_tp": 3}),
    # sequence parallel: one reduce-scatter a layer (the final norm gathers once more)
    "tp4-sp": (Topology(tp=4), (7,), dict(variant="sp", policy="rs+rsv"), {"all_gatherv@attn_tp": 7, "reduce_scatterv@attn_tp": 3}),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_collectives_a_layer_issues(case):
    topology, counts, kwargs, want = COUNTS[case]
    results = run_threaded(counted_grid_rank, topology, LAYERS, counts, **kwargs)
    assert all(issued == want for _, issued in results), [issued for _, issued in results]
    assert_matches_reference([(out, []) for out, _ in results], LAYERS, topology, counts)


def test_the_sequential_layer_issues_two_sums():
    """The same layers declared sequentially: the attention's and the FFN's sums each a collective."""
    results = run_threaded(counted_grid_rank, Topology(tp=2), SEQUENTIAL, (5,))
    assert all(issued == {"all_reduce@attn_tp": 3, "all_reduce@tp": 3} for _, issued in results)


@pytest.mark.gloo
def test_one_all_reduce_a_layer_under_gloo(gloo_world):
    topology = Topology(tp=2)
    results = gloo_world(2).run(counted_grid_rank, topology, LAYERS, (5,), mode="decode")
    assert all(issued == {"all_reduce@tp": 3} for _, issued in results)
    assert_matches_reference([(out, []) for out, _ in results], LAYERS, topology, (5,))


class Joining:
    """A fused consumer standing in for all-reduce + add + norm; it logs each owed sum it takes."""

    def __init__(self, log):
        self.log = log

    def attention_input(self, plan):
        norm = plan.norm
        return (FusedMlpInput(run=lambda owed, residual, fwd: self._run(norm, owed, residual), name="joining", completes=SumGroup.TP),)

    ffn_input = attention_input

    def _run(self, norm, owed, residual):
        self.log.append((type(owed).__name__, owed.sum_group, owed.declared))
        return add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)


def test_a_fused_consumer_takes_the_joined_sum():
    """The joined sum reaches the next attention's input as an ordinary deferred sum over TP;
    the fused candidate completes it, and the parallel FFN's own input asks no candidate."""
    logs = [[], []]
    results = run_threaded(lambda p: run_grid_rank(p, LAYERS, (5,), fusions=Joining(logs[p.rank])), Topology(tp=2))
    assert_matches_reference(results, LAYERS, Topology(tp=2), (5,))
    assert logs[0] == logs[1] == [("UnreducedOutput", SumGroup.TP, False)] * 2  # layers 1 and 2; the last completes at its exit


# --- the plan --------------------------------------------------------------------------------


def _layer(parallel, *, policy="ar", ffn=None, attn=None, **kwargs):
    return make_stages(
        (attn or declare_attn(), _norm()), (ffn or declare_ffn(parallel_residual=True), _norm()),
        parallel=parallel, reduction=policy, label="layer", **kwargs,
    )


def test_the_plan_says_how_each_sum_completes():
    attn, ffn = _layer(_planning(Topology(tp=2)), following=declare_ffn())
    ordinary = ffn.describe()["variants"]["ordinary"]
    assert ordinary["entry"][0].startswith("read the residual as the attention read it")
    assert "carry the attention's attn_tp partial" in ordinary["entry"][1]
    assert "one sum over tp completes both" in ordinary["exit"][0]
    assert ordinary["exit"][1].startswith("defer that all_reduce@tp to the next input")
    assert "carries it to its exit" in attn.describe()["variants"]["ordinary"]["exit"][0]
    _, ffn = _layer(_planning(Topology(tp=4, attn_dp=2)), policy="rs+rsv", following=declare_ffn())
    dp = ffn.describe()["variants"]["ordinary"]
    assert dp["entry"][-1] == "all_gatherv@attn_dp of the input to full rows"
    assert "this DP rank's slot of the full rows" in dp["exit"][0] and "attn_tp partial" in dp["exit"][0]
    assert dp["exit"][1].startswith("reduce_scatter@tp") and dp["exit"][2].startswith("else all_reduce@tp here")
    _, ffn = _layer(_planning(Topology(tp=2, attn_dp=2)), terminal=True)
    assert "complete: one attention-TP rank" in ffn.describe()["variants"]["ordinary"]["exit"][0]
    _, ffn = _layer(Parallel.single(), terminal=True)
    assert ffn.describe()["variants"]["ordinary"]["exit"] == [
        "add the attention's output (complete: one attention-TP rank) to this FFN's output (one rank: nothing to sum)"
    ]


# --- wrong combinations fail at construction, naming the stage ---------------------------------


class NotPlain:
    plain_add = False
    at_producer = False
    outlives_layer = True

    def apply(self, contribution, residual):
        return contribution + residual


class AtProducer(NotPlain):
    plain_add = True
    at_producer = True


class Rescaling:
    plain_norm = False
    before_gather = False

    def enter(self, h):
        return h

    def read(self, residual, norm):
        return norm(residual), residual * 2

    def update_and_read(self, update, contribution, residual, norm):
        return self.read(update.apply(contribution, residual), norm)


HALF = OutputTransform(lambda x: x * 0.5, name="half")

REFUSED = {
    "at the stack input": (lambda p: make_stages((declare_ffn(parallel_residual=True), _norm()), parallel=p, label="layer"),
                           "needs the attention it runs beside"),
    "after an FFN": (lambda p: make_stages((declare_ffn(), _norm()), (declare_ffn(parallel_residual=True), _norm()), parallel=p,
                                           label="layer"), "its previous stage is ffn"),
    "a MoE": (lambda p: _layer(p, ffn=declare_ffn(sparse=True, parallel_residual=True)), "cannot be a MoE"),
    "LOCAL_TAIL": (lambda p: _layer(p, ffn=declare_ffn(reduction=ProducerReduction.LOCAL_TAIL, parallel_residual=True)),
                   "LOCAL_TAIL compute does not"),
    "the attention's update": (lambda p: _layer(p, attn=declare_attn(update=NotPlain())), "the attention's update"),
    "its own update": (lambda p: _layer(p, ffn=declare_ffn(update=NotPlain(), parallel_residual=True)), "its own update"),
    "an update at the producer": (lambda p: _layer(p, attn=declare_attn(update=AtProducer())), "runs at its producer"),
    "the attention's transform": (lambda p: _layer(p, attn=declare_attn(output_transform=HALF)), "the attention's output_transform 'half'"),
    "its own transform": (lambda p: _layer(p, ffn=declare_ffn(output_transform=HALF, parallel_residual=True)),
                          "its own output_transform 'half'"),
    "a read that changes the residual": (lambda p: _layer(p, ffn=declare_ffn(read=Rescaling(), parallel_residual=True)),
                                         "neither a plain norm nor a quantizing norm read"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_wrong_combinations_fail_at_construction_naming_the_stage(case):
    build, phrase = REFUSED[case]
    with pytest.raises(ValueError) as info:
        build(Parallel.single())
    message = str(info.value)
    assert message.startswith("stage layer") and "parallel-residual FFN" in message and phrase in message and "\n" not in message


@requires_plugins("cp")
def test_context_parallel_is_refused_naming_the_stage():
    with pytest.raises(ValueError, match=r"stage layer\.1:ffn: .* has no context-parallel path \(attn_cp=2\)"):
        _layer(_planning(Topology(tp=2, attn_cp=2)), terminal=True)


def test_a_prepared_branch_cannot_be_parallel():
    with layer_stack(Parallel.single()):
        (source,) = make_stages((declare_ffn(), _norm()), label="source")
        with pytest.raises(ValueError, match="stage branch: .* cannot start a prepared branch"):
            make_stages((declare_ffn(parallel_residual=True), _norm()), prepared_from=source.declaration, label="branch")


def test_neighbours_must_describe_the_parallel_ffn():
    """The next layer's previous= and an attention's following= describe the parallel FFN as it is."""
    with layer_stack(Parallel.single()):
        _, ffn = _layer(None)
        with pytest.raises(ValueError, match="does not describe the stage built before it"):
            make_stages((declare_attn(), _norm()), previous=declare_ffn(), terminal=True)
    with layer_stack(Parallel.single()):
        make_attn_stage(attrs.evolve(declare_attn(), following=attrs.evolve(declare_ffn(), previous=declare_attn())), _norm())
        with pytest.raises(ValueError, match=r"following=ffn, but this call\s+starts with ffn\[parallel_residual\]"):
            make_ffn_stage(attrs.evolve(declare_ffn(parallel_residual=True), previous=declare_attn(), terminal=True), _norm())


# --- misuse at run time --------------------------------------------------------------------------


def _start(attn, fwd):
    residual_batch.start(fwd)
    x = torch.arange(3 * H, dtype=torch.float64).reshape(3, H) / 8
    return attn.finish(attn.prepare(x, fwd) * 0.5, fwd)


def test_the_attention_output_must_reach_the_parallel_ffn_pending():
    attn, ffn = _layer(Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 3)
    h = residual_batch.fold(_start(attn, fwd), fwd)
    with pytest.raises(RuntimeError, match="stage layer.1:ffn: .* no attention output is pending"):
        ffn.prepare(h, fwd)


def test_the_carried_output_is_taken_only_by_the_ffn_exit():
    attn, ffn = _layer(Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 3)
    x = ffn.prepare(_start(attn, fwd), fwd)
    with pytest.raises(RuntimeError, match="a parallel-residual FFN's prepare\\(\\) took the attention's output"):
        residual_batch.norm(x, fwd, _norm())
    with ffn.exit(fwd) as out:
        y = x * 0.25
    h = out.finish(y)
    assert torch.equal(h, residual_batch.complete_output(h, fwd))


def test_an_exit_without_its_prepare_fails():
    attn, ffn = _layer(Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 3)
    _start(attn, fwd)
    with ffn.exit(fwd) as out:
        y = torch.zeros(3, H, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="call this stage's prepare\\(\\) with the attention's handle first"):
        out.finish(y)


def test_no_pipeline_cut_lies_inside_a_parallel_layer():
    _, ffn = _layer(Parallel.single(), terminal=True)
    with pytest.raises(RuntimeError, match="cut before the attention"):
        ffn.from_pp({"hidden_states": None, "residual": None}, Forward(Parallel.single(), 3))


def _postprocessed_rank(parallel, *, scoped: bool):
    """One parallel layer at TP 2: the FFN through its exit scope, or computed without one
    (compute reduces itself) and handed to postprocess()."""
    stages = GridModel(attrs.evolve(LAYERS, stages=("attn", "pffn")), parallel)
    attn_stage, ffn_stage = stages.stages
    attn, ffn = stages.boundaries
    fwd = Forward(parallel, 5)
    residual_batch.start(fwd)
    x = grid_inputs(LAYERS, (5,))[0]
    h = attn.finish(attn_stage.compute(attn.prepare(x, fwd)), fwd)
    inp = ffn.prepare(h, fwd)
    if scoped:
        with ffn.exit(fwd) as out:
            y = ffn_stage.compute(inp)
        h = out.finish(y)
    else:
        h = ffn.postprocess(ffn_stage.compute(inp), fwd)
    return residual_batch.norm(h, fwd, stages.final_norm)


@torch.inference_mode()
def test_postprocess_completes_the_carried_output_too():
    scoped = run_threaded(lambda p: _postprocessed_rank(p, scoped=True), Topology(tp=2))
    unscoped = run_threaded(lambda p: _postprocessed_rank(p, scoped=False), Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(scoped, unscoped))


def test_a_quantizing_read_norms_the_residual_the_attention_read():
    """An FP8 read on the parallel FFN quantizes the norm of the residual before the attention's
    output joins it; the joined output then adds both branches to that residual."""
    from layer_boundary._residual.quant import Fp8Input, QuantNormRead, fp8_residual

    ops = fp8_residual("fp8_dynamic", attention=False)
    norms = [RMSNorm(H), RMSNorm(H)]
    with torch.no_grad():
        norms[1].weight.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
    attn, ffn = make_stages((declare_attn(residual=ops), norms[0]), (declare_ffn(residual=ops, parallel_residual=True), norms[1]),
                            parallel=Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 3)
    residual_batch.start(fwd)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    a = attn.prepare(x, fwd) * 0.5
    q = ffn.prepare(attn.finish(a, fwd), fwd)
    want = QuantNormRead("fp8_dynamic").read(x, norms[1])[0]
    assert isinstance(q, Fp8Input) and torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    with ffn.exit(fwd) as out:
        y = q.dequantize(torch.float32) * 0.25
    h = residual_batch.fold(out.finish(y), fwd)
    torch.testing.assert_close(h, x + a + y)
