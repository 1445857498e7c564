"""Every row of the guide's error table, with its exact message, plus construction checks."""

import pytest
import torch

from layer_boundary import (
    BatchFactsError,
    Forward,
    Messages,
    Parallel,
    ProducerReduction,
    RMSNorm,
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


def _norm():
    return RMSNorm(H, dtype=torch.float64)


def _layer(parallel, terminal=True, previous=None):
    return make_stages(
        (declare_attn(), _norm()), (declare_ffn(), _norm()), previous=previous, terminal=terminal, parallel=parallel
    )


def _run_ffn(ffn, h, fwd):
    with ffn.exit(fwd) as out:
        y = h * 0.5
    return out.finish(y)


def test_start_the_layer_stack_before_entering_a_stage():
    attn, _ = _layer(Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    with pytest.raises(RuntimeError) as info:
        attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd)
    assert str(info.value) == Messages.NOT_STARTED == "start the layer stack before entering a stage"


def test_rebinding_a_layer_output_is_rejected():
    attn, ffn = _layer(Parallel.single(), terminal=False)
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd)
    h = attn.finish(h, fwd)
    h = ffn.prepare(h, fwd)
    h = _run_ffn(ffn, h, fwd)  # single rank: a complete tensor
    rebound = h.clone()
    with pytest.raises(RuntimeError) as info:
        residual_batch.norm(rebound, fwd, _norm())
    assert str(info.value) == Messages.FOREIGN_OUTPUT
    assert str(info.value) == "output does not belong to this residual stream; change layer outputs through boundary accessors"


def test_another_microbatchs_output_is_rejected():
    attn, _ = _layer(Parallel.single())
    a, b = Forward(Parallel.single(), 2), Forward(Parallel.single(), 2)
    for fwd in (a, b):
        residual_batch.start(fwd)
    ha = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), a), a)
    attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), b), b)
    with pytest.raises(RuntimeError, match="does not belong to this residual stream"):
        residual_batch.complete_output(ha, b)


def test_write_the_residual_update_before_taking_the_final_output():
    attn, _ = _layer(Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    with pytest.raises(RuntimeError) as info:
        residual_batch.take_output(h, fwd)
    assert str(info.value) == "write the residual update before taking the final output"
    folded = residual_batch.fold(h, fwd)
    assert torch.equal(residual_batch.take_output(folded, fwd), folded)
    assert fwd.residual_stream is None


def test_no_stage_boundary_path_for_an_unsupported_variant():
    def fn(parallel):
        # a mixer that cannot take input gathered over attention TP has no sequence-parallel path
        (mixer,) = make_stages(
            (declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False), _norm()), terminal=True, parallel=parallel
        )
        fwd = Forward(parallel, 4, sequence_parallel=True)
        residual_batch.start(fwd)
        with pytest.raises(NotImplementedError) as info:
            mixer.prepare(torch.ones(4, H, dtype=torch.float64), fwd)
        cp = Forward(parallel, 4, cp=object())
        residual_batch.start(cp)
        with pytest.raises(NotImplementedError) as info2:
            mixer.prepare(torch.ones(4, H, dtype=torch.float64), cp)
        return str(info.value), str(info2.value)

    for sp, cp in run_threaded(fn, Topology(tp=2)):
        # the table's text is the first line, verbatim; the stage's reason, when known, the second
        message, reason = sp.split("\n")
        assert message == "no stage boundary path for the active SEQUENCE_PARALLEL batch"
        assert reason == "stage stages: its compute cannot take input gathered over attention TP (gathers_tp_input=False)"
        assert cp == "no stage boundary path for the active CONTEXT_PARALLEL batch"


def test_a_prepared_branch_must_enter_through_branch_input():
    attn, ffn = _layer(Parallel.single(), terminal=False)
    (branch,) = make_stages((declare_ffn(), _norm()), prepared_from=ffn.declaration, terminal=True, parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    with pytest.raises(RuntimeError) as info:
        branch.prepare(torch.ones(2, H, dtype=torch.float64), fwd)
    assert str(info.value) == "a prepared branch must enter through branch_input, not prepare"


def test_reduction_must_match_the_stage_kind():
    with pytest.raises(ValueError) as info:
        declare_ffn(reduction=ProducerReduction.PARTIAL)
    assert str(info.value) == "PARTIAL is not supported for ffn stages"
    with pytest.raises(ValueError) as info:
        declare_attn(reduction=ProducerReduction.LOCAL_TAIL)
    assert str(info.value) == "LOCAL_TAIL is not supported for attention stages"


class HalfUpdate:
    """A nonlinear-for-the-planner update: the new residual is (c + r) / 2."""

    plain_add = False
    at_producer = False
    outlives_layer = True

    def apply(self, contribution, residual):
        return (contribution + residual) * 0.5


def test_snapshot_requires_a_plain_residual_update():
    (attn,) = make_stages((declare_attn(update=HalfUpdate()), _norm()), terminal=True, parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    with pytest.raises(NotImplementedError) as info:
        residual_batch.snapshot(h, fwd)
    assert str(info.value) == "snapshot requires a plain residual update"


# --- construction-time validation -------------------------------------------------------------


def test_make_stages_validates_items_and_sources():
    p = Parallel.single()
    with pytest.raises(TypeError, match=r"a stage needs \(declaration, norm\[, options\]\)"):
        make_stages(declare_attn(), parallel=p)
    with pytest.raises(ValueError, match="at least one stage"):
        make_stages(parallel=p)
    with pytest.raises(ValueError, match="choose a previous output or a prepared branch input"):
        make_stages((declare_ffn(), _norm()), previous=declare_attn(), prepared_from=declare_attn(), parallel=p)
    with pytest.raises(TypeError, match="unsupported ffn stage options: \\['qkv_latent_func'\\]"):
        make_stages((declare_ffn(), _norm(), {"qkv_latent_func": None}), parallel=p)
    with pytest.raises(TypeError, match="stage sources must be declarations"):
        make_stages((declare_ffn(), _norm()), previous="attention", parallel=p)
    carrying = make_attn_stage(declare_attn(), _norm(), parallel=p).declaration
    import attrs

    with pytest.raises(ValueError, match="takes its source from make_stages"):
        make_stages((attrs.evolve(carrying, previous=declare_ffn()), _norm()), parallel=p)
    with pytest.raises(ValueError, match="takes terminal from make_stages"):
        make_stages((attrs.evolve(carrying, terminal=True), _norm()), parallel=p)


def test_auto_policy_must_be_resolved_before_construction():
    with pytest.raises(ValueError, match="boundary_reduction must be resolved before model construction"):
        make_stages((declare_attn(), _norm()), parallel=Parallel.single(), reduction="auto")
    with pytest.raises(ValueError, match="unknown reduction policy 'xs'"):
        make_stages((declare_attn(), _norm()), parallel=Parallel.single(), reduction="xs")


def test_stages_need_a_topology():
    with pytest.raises(RuntimeError, match="layer_stack"):
        make_stages((declare_attn(), _norm()))


def test_a_mixer_ending_its_call_must_name_following():
    with pytest.raises(ValueError, match="needs following="):
        make_stages((declare_attn(reduction=ProducerReduction.SCOPED), _norm()), parallel=Parallel.single())


def test_make_single_stages_check_their_kind_and_following():
    p = Parallel.single()
    with pytest.raises(TypeError, match="needs an attention declaration"):
        make_attn_stage(declare_ffn(), _norm(), parallel=p)
    with pytest.raises(TypeError, match="needs an FFN declaration"):
        make_ffn_stage(declare_attn(), _norm(), parallel=p)
    import attrs

    attn = declare_attn()
    wrong = attrs.evolve(declare_attn(), previous=declare_ffn())
    with pytest.raises(ValueError, match="names a previous stage"):
        make_attn_stage(attrs.evolve(attn, following=wrong), _norm(), parallel=p)


def test_neighbours_must_describe_each_other_inside_a_layer_stack():
    p = Parallel.single()
    with layer_stack(p, reduction="ar"):
        make_stages((declare_attn(), _norm()), (declare_ffn(sparse=True), _norm()))
        with pytest.raises(ValueError, match="does not describe the stage built before it"):
            make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), previous=declare_ffn())
    with layer_stack(p, reduction="ar"):
        make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), following=declare_attn())
        with pytest.raises(ValueError, match="declared following=attention, but this call starts with ffn"):
            make_stages((declare_ffn(), _norm()), previous=declare_ffn())
    with layer_stack(p, reduction="ar"):
        make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()))
        with pytest.raises(ValueError, match="starts a new stack"):
            make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()))


def test_batch_facts_are_checked_before_any_collective():
    def fn(parallel):
        errors = []
        for kwargs in (
            dict(num_tokens=3),
            dict(num_tokens=3, dp_counts=(3,)),
            dict(num_tokens=3, dp_counts=(2, 3) if parallel.attn_dp_rank == 0 else (3, 2)),
            dict(num_tokens=2, dp_counts=(2, 2), sequence_parallel=True),
            dict(num_tokens=-1, dp_counts=(1, 1)),
        ):
            n = kwargs.pop("num_tokens")
            with pytest.raises(BatchFactsError) as info:
                Forward(parallel, n, **kwargs)
            errors.append(str(info.value))
        return errors

    msgs = run_threaded(fn, Topology(tp=2, attn_dp=2))[0]
    assert "needs dp_counts" in msgs[0]
    assert "dp_counts has 1 entries but attn_dp is 2" in msgs[1]
    assert "disagrees with this rank's num_tokens" in msgs[2]
    assert "require attn_dp == 1" in msgs[3]
    assert "must be >= 0" in msgs[4]


@pytest.mark.parametrize("facts", [dict(sequence_parallel=True, input_scattered=True)], ids=["sp+scattered"])
def test_a_batch_is_at_most_one_of_sequence_parallel_input_scattered_and_cp(facts):
    with pytest.raises(BatchFactsError, match="a batch has at most one of sequence_parallel, input_scattered and cp"):
        Forward(Parallel.single(), 2, **facts)
    Forward(Parallel.single(), 2, sequence_parallel=True)  # one of them alone is a batch
