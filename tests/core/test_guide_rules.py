"""The guide's rules on producer updates, the integration checklist enforced at construction, and
the stream's less travelled paths."""

import attrs
import pytest

from layer_boundary.testing import requires_plugins
import torch

from layer_boundary import (
    Forward,
    Messages,
    OwedOutput,
    Parallel,
    ProducerReduction,
    RMSNorm,
    StreamState,
    Topology,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
    residual_batch,
)
from layer_boundary.testing.threaded import run_threaded

H = 4
MIXER = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)


def _norm():
    return RMSNorm(H, dtype=torch.float64)


def _x(n=3):
    return torch.arange(n * H, dtype=torch.float64).reshape(n, H) / 8


class AddAtProducer:
    """A plain add that asks to run at the producer's exit."""

    plain_add = True
    at_producer = True
    outlives_layer = True

    def apply(self, contribution, residual):
        return contribution + residual


class ShortLivedAdd:
    """A plain add whose parameters are not guaranteed to outlive the producer's layer."""

    plain_add = True
    at_producer = False
    outlives_layer = False

    def apply(self, contribution, residual):
        return contribution + residual


# --- producer updates ---------------------------------------------------------------------------


@pytest.mark.parametrize("update", [AddAtProducer(), ShortLivedAdd()], ids=["at_producer", "not_outliving"])
@pytest.mark.parametrize("topology", [Topology(tp=2), Topology(tp=4, attn_dp=2), Topology(tp=1)], ids=["tp2", "dp2xtp2", "tp1"])
def test_an_attention_update_at_the_producer_runs_at_finish(update, topology):
    """The attention's sum completes at finish() and its update is applied there: the stream is
    written, nothing is left for the FFN's input to complete or apply."""

    def fn(parallel):
        attn, ffn = make_stages((declare_attn(update=update), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 3, dp_counts=(3,) * parallel.attn_dp)
        residual_batch.start(fwd)
        x = _x()
        attn.prepare(x, fwd)
        share = x / parallel.attn_tp  # each attention-TP rank's partial: the sum is x
        h = attn.finish(share, fwd)
        state = fwd.residual_stream.state
        assert not isinstance(h, OwedOutput)
        y = ffn.prepare(h, fwd)  # under attention DP: every DP rank's rows (all alike here)
        return state, h, y

    for state, h, y in run_threaded(fn, topology):
        assert state is StreamState.WRITTEN
        assert torch.equal(h, _x() + _x())
        assert torch.equal(y, torch.cat([_norm()(_x() + _x())] * topology.attn_dp))


def test_a_mixer_before_an_ffn_with_an_update_at_the_producer_reduces_and_writes():
    def fn(parallel):
        mixer, ffn = make_stages((attrs.evolve(MIXER, update=AddAtProducer()), _norm()), (declare_ffn(), _norm()), terminal=True,
                                 parallel=parallel)
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        x = _x()
        mixer.prepare(x, fwd)
        with mixer.exit(fwd) as out:
            skips = out.skips_reduction
            y = x / 2 if skips else parallel.groups["attn_tp"].all_reduce(x / 2)
        h = out.finish(y)
        return skips, fwd.residual_stream.state, h

    for skips, state, h in run_threaded(fn, Topology(tp=2)):
        assert skips is False  # compute reduces: the sum is not left to the FFN
        assert state is StreamState.WRITTEN and torch.equal(h, _x() + _x())


def test_an_update_at_the_producer_is_never_deferred_and_its_consumer_expects_nothing():
    from layer_boundary.plugin import Owed

    parallel = Parallel.create(Topology(tp=2), 0, _planning_groups)
    attn, ffn = make_stages((declare_attn(update=ShortLivedAdd()), _norm()), (declare_ffn(update=ShortLivedAdd()), _norm()),
                            following=declare_attn(), parallel=parallel)
    (nxt,) = make_stages((declare_attn(), _norm()), previous=declare_ffn(update=ShortLivedAdd()), terminal=True, parallel=parallel)
    for boundary in (attn, ffn):
        assert all(p.exit.writes_at_exit and not p.exit.may_defer for p in boundary.plan.paths.values())
    assert all(p.entry.owed is Owed.NOTHING for p in list(ffn.plan.paths.values()) + list(nxt.plan.paths.values()))


def _planning_groups(name, ranks):
    from layer_boundary.cli.plan_cmd import PlanningCollectives

    return PlanningCollectives(name, ranks, 0)


# --- messages -----------------------------------------------------------------------------------


def test_the_variant_error_keeps_its_text_with_the_reason_on_a_second_line():
    def fn(parallel):
        (mixer,) = make_stages((MIXER, _norm()), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 4, sequence_parallel=True)
        residual_batch.start(fwd)
        with pytest.raises(NotImplementedError) as info:
            mixer.prepare(torch.ones(4, H, dtype=torch.float64), fwd)
        return str(info.value)

    for message in run_threaded(fn, Topology(tp=2)):
        first, second = message.split("\n")
        assert first == Messages.NO_VARIANT.format(variant="SEQUENCE_PARALLEL")
        assert second.startswith("stage stages: ") and "gathers_tp_input=False" in second


def test_an_ffn_stage_takes_only_fusions_and_says_why_publish_rows_is_allowed():
    with pytest.raises(TypeError) as info:
        make_stages((declare_ffn(), _norm(), {"qkv_latent_func": None}), parallel=Parallel.single())
    message = str(info.value)
    assert message.startswith("unsupported ffn stage options: ['qkv_latent_func']; an FFN stage takes fusions (the guide's only")
    assert "publish_rows=(kind, ...) is this library's addition" in message
    with pytest.raises(TypeError, match="unsupported ffn stage options: \\['producer'\\]"):
        make_ffn_stage(declare_ffn(), _norm(), {"producer": None}, parallel=Parallel.single())


def test_the_final_norm_capture_is_always_borrowed():
    """On attention-TP slices the final norm gathers the residual for its capture; the guide still
    has it pass owned=False (the collector copies what it keeps)."""

    def fn(parallel):
        (attn,) = make_stages((declare_attn(), _norm()), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 4, sequence_parallel=True)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(_x(4), fwd) * 0.0, fwd)
        seen = []
        residual_batch.norm(h, fwd, _norm(), capture_output=lambda value, *, owned: seen.append((value.shape[0], owned)))
        return seen

    assert run_threaded(fn, Topology(tp=2)) == [[(4, False)]] * 2


# --- the integration checklist, enforced at construction ---------------------------------------


def test_nothing_follows_a_terminal_stage_in_its_stack_but_a_nextn_module_is_its_own_stack():
    p = Parallel.single()
    with layer_stack(p, reduction="ar"):
        make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True)
        with pytest.raises(ValueError, match=r"declares previous=ffn right after a terminal stage"):
            make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), previous=declare_ffn(), terminal=True)
        make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True)  # NextN: previous=None
    # outside a stack: a stage built one by one that names a terminal stage as its previous
    last = make_ffn_stage(attrs.evolve(declare_ffn(), terminal=True), _norm(), parallel=p)
    with pytest.raises(ValueError, match=r"previous=ffn is a terminal stage: terminal=True marks the end"):
        make_attn_stage(attrs.evolve(declare_attn(), previous=last.declaration, terminal=True), _norm(), parallel=p)


def test_a_single_stage_s_following_must_name_it_as_previous():
    p = Parallel.single()
    with pytest.raises(ValueError, match=r"following=ffn must name this attention stage in its previous= field"):
        make_attn_stage(attrs.evolve(declare_attn(), following=declare_ffn()), _norm(), parallel=p)
    with pytest.raises(ValueError, match=r"following=mixer must name this ffn stage in its previous= field"):
        make_ffn_stage(attrs.evolve(declare_ffn(), following=MIXER), _norm(), parallel=p)
    make_attn_stage(attrs.evolve(declare_attn(), following=attrs.evolve(declare_ffn(), previous=declare_attn())), _norm(), parallel=p)


def test_stages_built_one_by_one_in_a_stack_are_checked_against_each_other():
    p = Parallel.single()
    attn = declare_attn()
    with layer_stack(p, reduction="ar"):
        make_attn_stage(attrs.evolve(attn, following=attrs.evolve(declare_ffn(sparse=True), previous=attn)), _norm())
        with pytest.raises(ValueError, match=r"declared following=ffn\[sparse\], but this call starts with ffn"):
            make_ffn_stage(attrs.evolve(declare_ffn(), previous=attn, terminal=True), _norm())
    with layer_stack(p, reduction="ar"):
        make_ffn_stage(declare_ffn(sparse=True, next_sparse=True), _norm())
        with pytest.raises(ValueError, match=r"previous=ffn\[sparse\] does not describe the stage built before it \(ffn\[sparse,next_sparse\]\)"):
            make_attn_stage(attrs.evolve(attn, previous=declare_ffn(sparse=True), terminal=True), _norm())  # next_sparse differs


class CountingFinalize:
    """A finalize provider that records every question and accepts only where told to."""

    def __init__(self, accept=lambda fwd: False):
        self.accept = accept
        self.asked = []

    def can_defer_finalize(self, plan, fwd):
        self.asked.append((fwd.variant.name, fwd.num_tokens))
        return self.accept(fwd)


def _moe_exit(parallel, provider, n, **forward_facts):
    attn, moe = make_stages((declare_attn(), _norm()), (declare_ffn(sparse=True), _norm(), {"fusions": provider}), terminal=True,
                            parallel=parallel, reduction="rs+rsv")
    fwd = Forward(parallel, n, dp_counts=(n,) * parallel.attn_dp, **forward_facts)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(n, H, dtype=torch.float64), fwd) * 0.0, fwd)
    x = moe.prepare(h, fwd)
    with moe.exit(fwd) as out:
        y = x * 0.0
    return out.finish(y)


@pytest.mark.parametrize("topology, n, facts, variant", [
    (Topology(tp=2), 0, {}, "ORDINARY"),  # an empty batch
    (Topology(tp=4, attn_dp=2), 3, {}, "ORDINARY"),  # attention DP: the exit reduce-scatters or scatters
    (Topology(tp=2), 4, {"sequence_parallel": True}, "SEQUENCE_PARALLEL"),
])
def test_can_defer_finalize_is_asked_on_every_exit_with_a_provider(topology, n, facts, variant):
    providers = []

    def fn(parallel):
        provider = CountingFinalize()
        providers.append(provider)
        _moe_exit(parallel, provider, n, **facts)
        return provider.asked

    assert run_threaded(fn, topology) == [[(variant, n)]] * topology.tp


def test_a_provider_accepting_a_handoff_where_the_exit_cannot_leave_one_is_an_error():
    from layer_boundary import FusionError

    def fn(parallel):
        with pytest.raises(FusionError, match=r"can_defer_finalize accepted a finalize handoff where the exit cannot leave one"):
            _moe_exit(parallel, CountingFinalize(accept=lambda fwd: True), 3)
        return True

    assert all(run_threaded(fn, Topology(tp=4, attn_dp=2)))


# --- what a consumer completes ------------------------------------------------------------------


def test_an_owed_sum_the_consumer_does_not_expect_raises_before_any_collective():
    """A stage built alone whose previous= says the producer writes the stream (an update at the
    producer) receives an attention output still owing its sum: it raises, naming the stage,
    instead of completing whatever arrived."""

    def fn(parallel):
        attn = make_attn_stage(declare_attn(), _norm(), parallel=parallel)
        ffn = make_ffn_stage(attrs.evolve(declare_ffn(), previous=declare_attn(update=AddAtProducer()), terminal=True), _norm(),
                             parallel=parallel)
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(_x(), fwd) * 0.5, fwd)
        assert isinstance(h, OwedOutput)
        with pytest.raises(RuntimeError, match=r"still owes UnreducedOutput\(declared sum over ATTN_TP.*declares nothing owed here"):
            ffn.prepare(h, fwd)
        return True

    assert all(run_threaded(fn, Topology(tp=2)))


def test_under_attention_dp_a_stage_expecting_a_complete_output_refuses_a_partial():
    def fn(parallel):
        attn = make_attn_stage(declare_attn(), _norm(), parallel=parallel)
        attn2 = make_attn_stage(attrs.evolve(declare_attn(), previous=declare_ffn(), terminal=True), _norm(), parallel=parallel)
        fwd = Forward(parallel, 3, dp_counts=(3, 3))
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(_x(), fwd) * 0.5, fwd)
        with pytest.raises(RuntimeError, match=r"previous=ffn declares nothing owed here"):
            attn2.prepare(h, fwd)
        return True

    assert all(run_threaded(fn, Topology(tp=4, attn_dp=2)))


class _Fused:
    """A consumer candidate that completes the sum itself (one all-reduce), then adds and norms."""

    def __init__(self, log):
        self.log = log

    def ffn_input(self, plan):
        from layer_boundary import FusedMlpInput, SumGroup
        from layer_boundary.plugin import add_rms_norm

        norm = plan.norm

        def run(owed, residual, fwd):
            self.log.append("fused")
            return add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)

        return (FusedMlpInput(run=run, name="fused", completes=SumGroup.ATTN_TP),)

    attention_input = ffn_input


@pytest.mark.parametrize("path", ["fused", "unfused", "captured"])
def test_a_consumed_owed_output_retains_nothing(path):
    """Once a consumer completed the sum (a fused candidate, the unfused path, or the general path
    a capture takes), the OwedOutput the caller still holds keeps neither the partial nor a value."""

    def fn(parallel):
        log = []
        opts = {"fusions": _Fused(log)} if path == "fused" else {}
        second = declare_attn() if path == "captured" else declare_ffn()  # a capture is taken at an attention input
        attn, ffn = make_stages((declare_attn(), _norm()), (second, _norm(), opts), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(_x(), fwd) * 0.5, fwd)
        contribution = h._contribution
        assert contribution.owed is not None
        if path == "captured":
            ffn.prepare(h, fwd, capture_output=lambda value, *, owned: None)
        else:
            ffn.prepare(h, fwd)
        return log, contribution.owed, contribution.value

    for log, owed, value in run_threaded(fn, Topology(tp=2)):
        assert log == (["fused"] if path == "fused" else [])
        assert owed is None and value is None


@pytest.mark.parametrize("consumer", ["stage", "final_norm"])
def test_a_contribution_on_a_stream_without_residual_is_read_as_the_residual(consumer):
    """A stream rebuilt from parts without a residual (`ResidualStream.arrive(h, None, update)`) has
    nothing to update: the contribution is the residual, read without an update (as fold() takes it)."""
    from layer_boundary import ResidualStream

    parallel = Parallel.single()
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=parallel)
    fwd = Forward(parallel, 3)
    stream, handle = ResidualStream.arrive(_x(), None, _PlainAdd())
    fwd.residual_stream = stream
    if consumer == "stage":
        y = ffn.prepare(handle, fwd)
        assert fwd.residual_stream.state is StreamState.WRITTEN and torch.equal(fwd.residual_stream.residual, _x())
    else:
        y = residual_batch.norm(handle, fwd, _norm())
        assert fwd.residual_stream is None
    assert torch.equal(y, _norm()(_x()))


class _PlainAdd(AddAtProducer):
    at_producer = False


# --- the stream's less travelled paths ----------------------------------------------------------


class _Handoff:
    """A finalize handoff that records whether its unfused completion ran."""

    sum_group = None
    group = None

    def __init__(self, value):
        self.value, self.completed = value, False

    def complete(self):
        self.completed = True
        return self.value

    @property
    def rows(self):
        return self.value.shape[0]


def _pending_handoff():
    from layer_boundary import Contribution, HandoffOutput

    handoff = type("Handoff", (_Handoff, HandoffOutput), {})(_x())
    fwd = Forward(Parallel.single(), 3)
    stream = residual_batch.start(fwd)
    stream.write(_x() * 2)
    return fwd, handoff, stream.record(Contribution(None, _PlainAdd(), owed=handoff))


def test_snapshot_raises_on_a_finalize_handoff_and_leaves_it_pending():
    fwd, handoff, h = _pending_handoff()
    with pytest.raises(NotImplementedError, match="a finalize handoff requires main-output capture"):
        residual_batch.snapshot(h, fwd)
    assert not handoff.completed and fwd.residual_stream.state is StreamState.PENDING
    assert torch.equal(residual_batch.fold(h, fwd), _x() * 3)  # still there for the consumer


def test_written_discards_a_pending_contribution():
    fwd, handoff, h = _pending_handoff()
    fresh = _x() * 5
    assert residual_batch.written(fresh, fwd) is fresh
    stream = fwd.residual_stream
    assert stream.state is StreamState.WRITTEN and stream.pending is None and stream.residual is fresh
    assert not handoff.completed  # discarded, never completed
    with pytest.raises(RuntimeError, match="output does not belong to this residual stream"):
        residual_batch.norm(h, fwd, _norm())  # the discarded output is foreign now


def test_the_final_norm_releases_the_stream_before_its_norm_and_capture_run():
    seen = []

    class Watching(RMSNorm):
        def add_forward(self, x, residual):
            seen.append(fwd.residual_stream)
            return super().add_forward(x, residual)

    parallel = Parallel.single()
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=parallel)
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(_x(), fwd), fwd)
    y = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        pass
    h = out.finish(y)

    def capture(value, *, owned):
        seen.append(fwd.residual_stream)
        raise KeyError("collector full")

    with pytest.raises(KeyError):
        residual_batch.norm(h, fwd, Watching(H, dtype=torch.float64), capture_output=capture)
    assert seen == [None, None] and fwd.residual_stream is None


# --- a PARTIAL attention's producer ---------------------------------------------------------------


class _Attention(torch.nn.Module):
    def __init__(self, group, *, reduce_results):
        from layer_boundary import RowParallelLinear

        super().__init__()
        self.o_proj = RowParallelLinear(H, H, group, reduce_results=reduce_results, dtype=torch.float64)


class _EngineRowLinear(torch.nn.Module):
    """An engine's own row-parallel layer: it carries reduce_results and tp_size as engines' do."""

    def __init__(self, reduce_results, tp_size=2):
        super().__init__()
        self.reduce_results, self.tp_size = reduce_results, tp_size


def test_a_partial_attention_whose_output_projection_reduces_is_refused_at_construction():
    parallel = Parallel.create(Topology(tp=2), 0, _planning_groups)
    group = parallel.groups["attn_tp"]
    with pytest.raises(ValueError, match=r"PARTIAL attention .* reduces its own output in o_proj: the sum would run twice"):
        make_stages((declare_attn(), _norm(), {"producer": _Attention(group, reduce_results=True)}), (declare_ffn(), _norm()),
                    terminal=True, parallel=parallel)
    make_stages((declare_attn(), _norm(), {"producer": _Attention(group, reduce_results=False)}), (declare_ffn(), _norm()),
                terminal=True, parallel=parallel)
    # a mixer's compute reduces unless its exit scope says otherwise: nothing to check
    make_stages((MIXER, _norm(), {"producer": _Attention(group, reduce_results=True)}), (declare_ffn(), _norm()), terminal=True,
                parallel=parallel)
    single = Parallel.single()  # a sum over one rank is no sum
    make_stages((declare_attn(), _norm(), {"producer": _Attention(single.groups["attn_tp"], reduce_results=True)}),
                (declare_ffn(), _norm()), terminal=True, parallel=single)


def test_the_producer_check_is_offered_for_a_model_s_own_modules():
    from layer_boundary import check_partial_producer

    attn = torch.nn.Module()
    attn.dense = _EngineRowLinear(True)
    with pytest.raises(ValueError, match=r"my attention is a PARTIAL attention .* in dense"):
        check_partial_producer(attn, stage="my attention")
    check_partial_producer(_EngineRowLinear(False))
    check_partial_producer(_EngineRowLinear(True, tp_size=1))
    custom = torch.nn.Module()
    custom.out = torch.nn.Linear(H, H)
    custom.out.all_reduces = True
    with pytest.raises(ValueError, match=r"in out"):
        check_partial_producer(custom, reduces=lambda m: getattr(m, "all_reduces", False))


@requires_plugins("models")
def test_the_reference_models_check_their_attention_at_construction(monkeypatch):
    """The core's reference decoder passes its attention as the stage's producer: an output
    projection built reducing (the silent double sum at TP=2) fails at construction."""
    from layer_boundary_models import attention as attention_module

    original = attention_module.TPAttention.__init__

    def reducing(self, *args, **kwargs):
        kwargs["reduce_results"] = True
        original(self, *args, **kwargs)

    monkeypatch.setattr(attention_module.TPAttention, "__init__", reducing)
    from layer_boundary_models import build_model, model_config

    parallel = Parallel.create(Topology(tp=2), 0, _planning_groups)
    with pytest.raises(ValueError, match=r"reduces its own output in o_proj"):
        build_model(model_config("qwen3"), parallel)


# --- capture with post_residual_addition ----------------------------------------------------------


@pytest.mark.parametrize("topology, facts", [(Topology(tp=2), {}), (Topology(tp=2), {"sequence_parallel": True}), (Topology(tp=1), {})],
                         ids=["tp2", "tp2-sp", "tp1"])
def test_post_residual_addition_joins_the_residual_after_the_capture(topology, facts):
    """prepare(..., post_residual_addition=t, capture_output=...) captures output plus residual
    before the addition; the residual and the read then include t."""

    def fn(parallel):
        attn, attn2 = make_stages((declare_attn(), _norm()), (declare_attn(), _norm()), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 4, **facts)
        residual_batch.start(fwd)
        x, t = _x(4), torch.full((4, H), 0.25, dtype=torch.float64)
        attn.prepare(x, fwd)
        h = attn.finish(x / parallel.attn_tp, fwd)  # the sum is x
        seen = []
        y = attn2.prepare(h, fwd, post_residual_addition=t, capture_output=lambda v, *, owned: seen.append((v.clone(), owned)))
        out = residual_batch.norm(attn2.finish(y * 0.0, fwd), fwd, _norm(), capture_output=lambda v, *, owned: seen.append((v.clone(), owned)))
        return seen, y, out, h

    x, t = _x(4), torch.full((4, H), 0.25, dtype=torch.float64)
    for seen, y, out, h in run_threaded(fn, topology):
        (captured, owned), (final, _) = seen
        assert torch.equal(captured, x + x) and owned
        assert torch.equal(y, _norm()(x + x + t)) and torch.equal(final, x + x + t)
        if topology.tp > 1:
            assert h._contribution.owed is None  # consumed


def test_post_residual_addition_is_refused_where_it_cannot_apply():
    p = Parallel.single()
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=p)
    fwd = Forward(p, 3)
    residual_batch.start(fwd)
    with pytest.raises(ValueError, match="post_residual_addition is added to the residual after the producer's update"):
        attn.prepare(_x(), fwd, post_residual_addition=_x())
    h = attn.finish(attn.prepare(_x(), fwd), fwd)
    with pytest.raises(TypeError, match="FFN prepare\\(\\) does not accept post_residual_addition"):
        ffn.prepare(h, fwd, post_residual_addition=_x())


# --- next_sparse and the TBO handoff rows ---------------------------------------------------------


def _split_point_stack(parallel, two_batch_overlap):
    dense_before_sparse = declare_ffn(next_sparse=True)
    with layer_stack(parallel, reduction="ar", two_batch_overlap=two_batch_overlap):
        attn0, ffn0 = make_stages((declare_attn(), _norm()), (dense_before_sparse, _norm()))
        attn1, moe1 = make_stages((declare_attn(), _norm()), (declare_ffn(sparse=True), _norm()), previous=dense_before_sparse,
                                  terminal=True)
    return attn0, ffn0, attn1, moe1


@pytest.mark.parametrize("two_batch_overlap", [True, False])
def test_next_sparse_makes_the_dense_to_sparse_handoff_complete_under_tbo(two_batch_overlap):
    """Where a dense FFN meets a sparse layer (declare_ffn(next_sparse=True)) in a model run with
    two-batch overlap, the batch may split: the FFN completes its output at its exit and the next
    input expects nothing. Without TBO the sum defers to the next input as usual."""
    from layer_boundary import BatchVariant, get_forward
    from layer_boundary.plugin import Owed

    def fn(parallel):
        attn0, ffn0, attn1, moe1 = _split_point_stack(parallel, two_batch_overlap)
        ordinary = BatchVariant.ORDINARY
        plan = (ffn0.plan.paths[ordinary].exit.may_defer, attn1.plan.paths[ordinary].entry.owed)
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        h = attn0.finish(attn0.prepare(_x(), fwd) / parallel.attn_tp, fwd)
        y = ffn0.prepare(h, fwd)
        with ffn0.exit(fwd) as out:
            y = y / parallel.tp if get_forward().fuse_mlp_allreduce else y
        h = out.finish(y)
        x1 = attn1.prepare(h, fwd)
        return plan, isinstance(h, OwedOutput), x1

    results = run_threaded(fn, Topology(tp=2))
    for plan, owed, x1 in results:
        if two_batch_overlap:
            assert plan == (False, Owed.NOTHING) and not owed
        else:
            assert plan == (True, Owed.DYNAMIC) and owed
        assert torch.equal(x1, results[0][2])
