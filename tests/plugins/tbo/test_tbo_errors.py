"""The guide's TBO rules as clear errors: one stream per microbatch, no exit() scope across a
yield point, the parent batch's stream unused while split; and bad input raised up front."""

import pytest
import torch

from layer_boundary import (
    Forward,
    Messages as CoreMessages,
    MissingPluginError,
    Parallel,
    Topology,
    exit_scope_open,
    get_forward,
    residual_batch,
    two_batch_overlap,
)
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_tbo.messages import Messages

from tbo_exact_stack import ExactStack, inputs_of

LAYERS = ("ffn", "moe")


def _setup(parallel=None, rows=6):
    parallel = parallel or Parallel.single()
    model = ExactStack(LAYERS, parallel)
    fwd = Forward(parallel, rows, dp_counts=(rows,) * parallel.topology.attn_dp)
    residual_batch.start(fwd)
    return model, fwd, inputs_of([[rows]])[0]


def _run(model, fwd, x, stages, **kwargs):
    with torch.inference_mode():
        return two_batch_overlap(fwd).run(stages, x, fwd, context=lambda a, b: [b - a], **kwargs)


def test_holding_an_exit_scope_across_a_yield_point_is_rejected():
    model, fwd, x = _setup()
    ran = []

    def stages(h, mb, segments):
        attn_b, ffn_b = model.boundaries[0], model.boundaries[1]
        h = attn_b.finish(model.stages[0].compute(attn_b.prepare(h, mb), segments), mb)
        x = ffn_b.prepare(h, mb)
        with ffn_b.exit(mb) as out:
            ran.append((mb.microbatch, get_forward().fuse_mlp_allreduce))
            y = model.stages[1].compute(x)
            yield  # the flags of this scope would reach the other microbatch's compute
        return out.finish(y)

    with pytest.raises(RuntimeError) as info:
        _run(model, fwd, x, stages)
    assert str(info.value) == Messages.HELD_EXIT.format(index=0)
    assert "microbatch 0 reached a TBO yield point with an exit() scope open" in str(info.value)
    assert ran == [(0, False)]  # microbatch 1 never started
    assert not exit_scope_open()  # the failed run left no flags behind


def test_the_exit_scope_rule_holds_for_a_batch_that_runs_whole():
    """A batch too small to split still runs through the same checks, so the bug shows early."""
    model, fwd, x = _setup(rows=1)

    def stages(h, mb, segments):
        with model.boundaries[1].exit(mb):
            yield
        return h

    with pytest.raises(RuntimeError, match="reached a TBO yield point with an exit"):
        _run(model, fwd, x, stages)


def test_sharing_one_stream_between_microbatches_is_rejected():
    model, fwd, x = _setup()
    seen = []

    def stages(h, mb, segments):
        seen.append(mb)
        if mb.microbatch == 1:
            mb.residual_stream = seen[0].residual_stream  # "reuse" microbatch 0's stream
            yield
        h = yield from model.layer(0, h, mb, segments)
        return h

    with pytest.raises(RuntimeError) as info:
        _run(model, fwd, x, stages)
    assert str(info.value) == Messages.SHARED_STREAM


def test_a_scheduler_of_its_own_that_shares_a_stream_fails_at_the_merge():
    model, fwd, x = _setup()
    tbo = two_batch_overlap(fwd)
    first, second = tbo.split(x, fwd, tbo.plan(fwd))
    second.forward.residual_stream = first.forward.residual_stream
    with pytest.raises(RuntimeError) as info:
        tbo.merge((first, second), (first.hidden, first.hidden), fwd)
    assert str(info.value) == Messages.SHARED_STREAM


def test_using_the_parent_batchs_forward_inside_a_microbatch_is_rejected():
    model, fwd, x = _setup()

    def stages(h, mb, segments):
        h = yield from model.layer(0, h, fwd, segments)  # the closure's parent Forward, not `mb`
        return h

    with pytest.raises(RuntimeError) as info:
        _run(model, fwd, x, stages)
    assert str(info.value) == Messages.PARENT_STREAM


def test_passing_the_other_microbatchs_output_is_rejected():
    model, fwd, x = _setup()
    handles = {}

    def stages(h, mb, segments):
        attn_b = model.boundaries[0]
        handles[mb.microbatch] = attn_b.finish(model.stages[0].compute(attn_b.prepare(h, mb), segments), mb)
        yield
        other = handles[1 - mb.microbatch]
        model.boundaries[1].prepare(other, mb)
        return h

    with pytest.raises(RuntimeError) as info:
        _run(model, fwd, x, stages)
    assert str(info.value) == CoreMessages.FOREIGN_OUTPUT


def test_stages_must_be_a_generator_function():
    model, fwd, x = _setup()
    with pytest.raises(TypeError, match="stages must be a generator function"):
        _run(model, fwd, x, lambda h, mb, facts: h)


def test_overlap_is_not_run_inside_a_stage():
    model, fwd, x = _setup()
    with model.boundaries[1].exit(fwd):
        with pytest.raises(RuntimeError) as info:
            _run(model, fwd, x, model.stages_of(0, 2))
    assert str(info.value) == Messages.NESTED


@pytest.mark.parametrize(
    "split, message",
    [
        ((7,), "gives DP rank 0 7 rows for microbatch 0, outside 0..6"),
        ((1, 2), "names 2 attention-DP ranks but the batch has 1"),
        ((-1,), "outside 0..6"),
    ],
)
def test_a_bad_split_is_rejected_before_any_collective(split, message):
    model, fwd, x = _setup()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _run(model, fwd, x, model.stages_of(0, 2), split=split)
    assert fwd.residual_stream.state == "initial"  # nothing was split


def test_bad_split_fails_on_every_rank_without_a_hang():
    def fn(parallel):
        model, fwd, x = _setup(parallel)
        with pytest.raises(ValueError, match="outside"):
            _run(model, fwd, x, model.stages_of(0, 2), split=(9, 1))
        return True

    assert run_threaded(fn, Topology(tp=2, attn_dp=2), timeout=10) == [True, True]


def test_missing_plugin_names_the_distribution(monkeypatch, fresh_registry):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "tbo")
    fwd = Forward(Parallel.single(), 2)
    with pytest.raises(MissingPluginError) as info:
        two_batch_overlap(fwd)
    assert info.value.distribution == "layer-boundary-tbo"
    assert "two-batch overlap needs the layer-boundary-tbo distribution" in str(info.value)


def test_the_merge_releases_the_microbatch_streams():
    """After the merge the parent's stream holds the rows; the microbatch Forwards hold none."""
    model, fwd, x = _setup()
    tbo = two_batch_overlap(fwd)
    first, second = tbo.split(x, fwd, tbo.plan(fwd))
    outs = []
    for mb in (first, second):
        attn_b = model.boundaries[0]
        outs.append(attn_b.finish(model.stages[0].compute(attn_b.prepare(mb.hidden, mb.forward), [mb.forward.num_tokens]),
                                  mb.forward))
    h = tbo.merge((first, second), outs, fwd)
    assert first.forward.residual_stream is None and second.forward.residual_stream is None
    assert fwd.residual_stream is not None and fwd.residual_stream.handle is h
