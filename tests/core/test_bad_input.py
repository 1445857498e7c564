"""Bad input: the right error on the rank that made it, before any collective starts."""

import pytest
import torch

from layer_boundary import CollectiveCounter, CountingCollectives, Forward, RMSNorm, Topology, declare_attn, declare_ffn, make_stages, residual_batch
from layer_boundary.testing.threaded import run_threaded

H = 4


def _stack(parallel, counter):
    counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    norm = lambda: RMSNorm(H, dtype=torch.float64)  # noqa: E731
    return counted, make_stages((declare_attn(), norm()), (declare_ffn(), norm()), terminal=True, parallel=counted)


def _attempt(parallel, counter, spoil):
    """Run one layer whose compute output is spoiled on rank 1; report the error message and
    how many collectives this rank had issued when it raised."""
    counted, (attn, ffn) = _stack(parallel, counter)
    fwd = Forward(counted, 3)
    residual_batch.start(fwd)
    x = torch.ones(3, H, dtype=torch.float64)
    try:
        h = attn.prepare(x, fwd)
        out = h * 0.5
        if parallel.rank == 1:
            out = spoil(out)
        attn.finish(out, fwd)
    except (ValueError, TypeError) as exc:
        return str(exc), sum(counter.calls.values())
    return None, sum(counter.calls.values())


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda o: o[:2], "expected 3 rows"),
        (lambda o: torch.cat([o, o], dim=1), "hidden size 8, but the stage's norm has 4"),
        (lambda o: o.float(), "is torch.float32 but the residual is torch.float64"),
        (lambda o: o.to("meta"), "is on meta but the residual is on cpu"),
    ],
    ids=["rows", "hidden", "dtype", "device"],
)
def test_a_spoiled_output_is_caught_before_any_collective(spoil, message):
    counter = CollectiveCounter()
    results = run_threaded(lambda p: _attempt(p, counter, spoil), Topology(tp=2))
    error, issued = results[1]
    assert error is not None and message in error
    assert issued == 0  # attention's prepare at stack entry issues none, and finish raised first


def test_wrong_stack_input_rows():
    def fn(parallel):
        (attn, _) = make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 3)
        residual_batch.start(fwd)
        with pytest.raises(ValueError, match="stack input has shape \\(4, 4\\), expected 3 rows"):
            attn.prepare(torch.ones(4, H), fwd)
        return True

    assert all(run_threaded(fn, Topology(tp=2)))


def test_non_contiguous_inputs_give_the_same_answer():
    def fn(parallel, transpose):
        (attn, ffn) = make_stages((declare_attn(), RMSNorm(H, dtype=torch.float64)), (declare_ffn(), RMSNorm(H, dtype=torch.float64)), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 4)
        residual_batch.start(fwd)
        base = torch.arange(16, dtype=torch.float64).reshape(4, 4) / 8
        x = base.t().contiguous().t() if transpose else base  # same values, column-major
        h = attn.prepare(x, fwd)
        out = (h * 0.5).t().contiguous().t() if transpose else h * 0.5
        assert out.is_contiguous() is not transpose
        h = attn.finish(out, fwd)
        y = ffn.prepare(h, fwd)
        with ffn.exit(fwd) as o:
            y = parallel.groups["tp"].all_reduce(y * 0.25)
        return residual_batch.norm(o.finish(y), fwd, RMSNorm(H, dtype=torch.float64))

    plain = run_threaded(lambda p: fn(p, False), Topology(tp=2))
    strided = run_threaded(lambda p: fn(p, True), Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(plain, strided))
