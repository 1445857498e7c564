"""The residual stream and the residual_batch helpers."""

import pytest
import torch

from layer_boundary import (
    Forward,
    OwedOutput,
    Parallel,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import add_rms_norm
from layer_boundary.testing.threaded import run_threaded

H = 4


def _norm(scale=1.0):
    n = RMSNorm(H, dtype=torch.float64, compute_dtype=torch.float64)
    with torch.no_grad():
        n.weight.mul_(scale)
    return n


def _x(n=3, seed=0):
    return torch.randn(n, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _attention_output(parallel, n=3):
    """(attn boundary, ffn boundary, forward, owed handle, input, expected partial sum)."""
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm(2.0)), terminal=True, parallel=parallel)
    fwd = Forward(parallel, n)
    residual_batch.start(fwd)
    x = _x(n)
    a = attn.prepare(x, fwd)
    h = attn.finish(a * 0.5, fwd)  # each attn-TP rank contributes a * 0.5
    return attn, ffn, fwd, h, x, a * 0.5 * parallel.attn_tp


def test_owed_output_is_opaque():
    def fn(parallel):
        _, _, _, h, _, _ = _attention_output(parallel)
        assert isinstance(h, OwedOutput)
        for op in (lambda: h + 1, lambda: h[0], lambda: h.shape, lambda: torch.relu(h), lambda: bool(h)):
            with pytest.raises(TypeError):
                op()
        with pytest.raises(TypeError, match="immutable"):
            h.x = 1
        return repr(h)

    assert "declared sum over ATTN_TP" in run_threaded(fn, Topology(tp=2))[0]


def test_complete_output_then_prepare_completes_once():
    def fn(parallel):
        _, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        done = residual_batch.complete_output(h, fwd)
        assert torch.equal(done, partial_sum)
        inp = ffn.prepare(done, fwd)
        want, _ = add_rms_norm(ffn.plan.norm, partial_sum, x)
        return torch.equal(inp, want)

    assert all(run_threaded(fn, Topology(tp=2)))


def test_fold_written_and_entry_on_a_written_stream():
    def fn(parallel):
        attn, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        folded = residual_batch.fold(h, fwd)
        assert torch.equal(folded, partial_sum + x)
        assert fwd.residual_stream.state == "written"
        inp = ffn.prepare(folded, fwd)  # reads without another update
        assert torch.equal(inp, ffn.plan.norm(partial_sum + x))
        # written() replaces the stream; a stack-entry stage then skips its enter
        fwd2 = Forward(parallel, 3)
        residual_batch.start(fwd2)
        w = residual_batch.written(x * 2, fwd2)
        assert torch.equal(attn.prepare(w, fwd2), attn.plan.norm(x * 2))
        return True

    assert all(run_threaded(fn, Topology(tp=2)))


def test_add_to_output_adds_once_and_keeps_the_update_pending():
    def fn(parallel):
        _, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        extra = torch.full((3, H), 0.125, dtype=torch.float64)
        h2 = residual_batch.add_to_output(h, fwd, extra)
        assert fwd.residual_stream.state == "pending"
        inp = ffn.prepare(h2, fwd)
        want, _ = add_rms_norm(ffn.plan.norm, partial_sum + extra, x)
        return torch.equal(inp, want)

    assert all(run_threaded(fn, Topology(tp=2)))


def test_snapshot_sums_a_copy_and_leaves_the_declared_sum_owed():
    def fn(parallel):
        _, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        snap = residual_batch.snapshot(h, fwd)
        assert torch.equal(snap, partial_sum + x)
        assert isinstance(fwd.residual_stream.pending.owed, type(fwd.residual_stream.pending.owed))
        assert fwd.residual_stream.pending.value is None  # still owed
        inp = ffn.prepare(h, fwd)
        want, _ = add_rms_norm(ffn.plan.norm, partial_sum, x)
        return torch.equal(inp, want)

    assert all(run_threaded(fn, Topology(tp=2)))


def test_capture_output_snapshots_a_declared_sum_on_a_copy():
    def fn(parallel):
        attn, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        handle, snap = ffn.capture_output(h, fwd)
        assert handle is h and torch.equal(snap, partial_sum + x)
        return True

    assert all(run_threaded(fn, Topology(tp=2)))


def test_norm_skip_empty_still_completes_owed_work():
    def fn(parallel):
        (attn,) = make_stages((declare_attn(), _norm()), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 0)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(torch.zeros(0, H, dtype=torch.float64), fwd), fwd)
        out = residual_batch.norm(h, fwd, _norm(), skip_empty=True)
        assert fwd.residual_stream is None
        return tuple(out.shape)

    assert run_threaded(fn, Topology(tp=2)) == [(0, H), (0, H)]


def test_norm_capture_output_is_borrowed():
    captured = []

    def fn(parallel):
        _, ffn, fwd, h, x, partial_sum = _attention_output(parallel)
        out = residual_batch.norm(h, fwd, _norm(), capture_output=lambda v, owned: captured.append(owned))
        return torch.equal(out, _norm()(partial_sum + x))

    assert all(run_threaded(fn, Topology(tp=2)))
    assert captured == [False, False]


def test_prepare_capture_at_stack_entry_captures_the_input():
    captured = []
    attn, _ = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 3)
    residual_batch.start(fwd)
    x = _x()
    attn.prepare(x, fwd, capture_output=lambda v, owned: captured.append((v, owned)))
    assert captured[0][0] is x and captured[0][1] is False


def test_ffn_prepare_rejects_capture():
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 3)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(_x(), fwd), fwd)
    with pytest.raises(TypeError, match="does not accept capture_output"):
        ffn.prepare(h, fwd, capture_output=lambda v, owned: None)


def test_capture_ownership_follows_the_next_input_path():
    """The residual an attention read produces is next consumed by its FFN's input; the
    built-in completion never writes it in place, so the capture may keep it (owned=True)."""
    flags = []

    def fn(parallel):
        attn, ffn, attn2, ffn2 = make_stages(
            (declare_attn(), _norm()), (declare_ffn(), _norm()), (declare_attn(), _norm()), (declare_ffn(), _norm()),
            terminal=True, parallel=parallel,
        )
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(_x(), fwd), fwd)
        x = ffn.prepare(h, fwd)
        with ffn.exit(fwd) as out:
            y = x * 0.5
        h = out.finish(y)
        attn2.prepare(h, fwd, capture_output=lambda v, owned: flags.append(owned))
        return True

    run_threaded(fn, Topology(tp=2))
    assert flags == [True, True]


def test_postprocess_records_a_complete_output():
    def fn(parallel):
        attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=parallel)
        counts = (3, 1)
        fwd = Forward(parallel, counts[parallel.attn_dp_rank], dp_counts=counts)
        residual_batch.start(fwd)
        x = _x(counts[parallel.attn_dp_rank], seed=parallel.attn_dp_rank)
        h = attn.finish(attn.prepare(x, fwd), fwd)
        full = ffn.prepare(h, fwd)  # gathered to 4 full rows
        assert full.shape[0] == 4
        h = ffn.postprocess(full * 0.5, fwd)  # "fully reduced" output on full rows
        assert isinstance(h, torch.Tensor) and h.shape[0] == counts[parallel.attn_dp_rank]
        return True

    assert all(run_threaded(fn, Topology(tp=2, attn_dp=2)))


def test_start_again_mid_stack_is_caught():
    attn, ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 3)
    residual_batch.start(fwd)
    with pytest.raises(RuntimeError, match="has a producer .* residual stream is empty"):
        ffn.prepare(_x(), fwd)


def test_lean_calls_refill_the_consumed_contribution():
    """A lean prepare() keeps the complete contribution it consumed as the stream's spare, with its
    value dropped; the next lean finish() refills that object with its own update and rows."""
    parallel = Parallel.single()
    layers = [
        make_stages(
            (declare_attn(), _norm()), (declare_ffn(), _norm(2.0)), previous=declare_ffn() if i else None, terminal=i == 1, parallel=parallel
        )
        for i in range(2)
    ]
    fwd = Forward(parallel, 3)
    stream = residual_batch.start(fwd)
    x = _x()
    h = layers[0][0].prepare(x, fwd)
    h = layers[0][0].finish(h, fwd)
    attn_contribution = stream.pending
    h = layers[0][1].prepare(h, fwd)
    assert stream.spare is attn_contribution and attn_contribution.value is None  # consumed: retains nothing
    with layers[0][1].exit(fwd) as out:
        y = h * 3
    h = out.finish(y)
    assert stream.spare is None and stream.pending is attn_contribution  # refilled, not rebuilt
    assert attn_contribution.value is y and attn_contribution.update is layers[0][1].declaration.update
    assert attn_contribution.owed is None and attn_contribution.transform is None
    h = layers[1][0].prepare(h, fwd)
    assert stream.spare is attn_contribution and attn_contribution.value is None
    h = layers[1][0].finish(h * 5, fwd)
    assert stream.pending is attn_contribution and attn_contribution.update is layers[1][0].declaration.update
    h = layers[1][1].prepare(h, fwd)
    with layers[1][1].exit(fwd) as out:
        y = h + 1
    out.finish(y)
    # the numbers of the unfused reference, layer by layer
    inp, res = add_rms_norm(layers[0][1].plan.norm, layers[0][0].plan.norm(x), x)
    inp, res = add_rms_norm(layers[1][0].plan.norm, inp * 3, res)
    inp, res = add_rms_norm(layers[1][1].plan.norm, inp * 5, res)
    assert torch.allclose(stream.residual, res) and torch.allclose(stream.pending.value, inp + 1)
