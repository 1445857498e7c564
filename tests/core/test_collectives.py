import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary.collectives import CollectiveCounter, CountingCollectives, split_sizes
from layer_boundary.testing.threaded import CollectiveAborted, ThreadWorld, run_threaded

from collective_cases import every_collective, expected


def _check(results, n):
    for rank, got in enumerate(results):
        want = expected(n, rank)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].shape == want[key].shape, (rank, key)
            assert torch.equal(got[key], want[key]), (rank, key)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_op_in_the_threaded_world(n):
    _check(run_threaded(every_collective, Topology(tp=n)), n)


@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 4])
def test_every_op_under_gloo_equals_the_threaded_world(gloo_world, n):
    gloo = gloo_world(n).run(every_collective, Topology(tp=n))
    _check(gloo, n)
    threaded = run_threaded(every_collective, Topology(tp=n))
    for a, b in zip(gloo, threaded):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_single_rank_parallel_is_identity():
    g = Parallel.single().groups["tp"]
    x = torch.randn(3, 2)
    assert g.all_reduce(x) is x and g.all_gatherv(x, [3]) is x and g.reduce_scatterv(x, [3]) is x


def test_split_sizes():
    assert split_sizes(7, 3) == (3, 2, 2)
    assert split_sizes(0, 2) == (0, 0)
    assert split_sizes(2, 4) == (1, 1, 0, 0)


def test_size_mismatches_are_clear_errors():
    g = Parallel.single().groups["tp"]

    def bad(parallel):
        t = parallel.groups["tp"]
        with pytest.raises(ValueError, match="do not add up"):
            t.reduce_scatterv(torch.zeros(3, 1), [1, 1])
        with pytest.raises(ValueError, match="needs 2 sizes"):
            t.all_gatherv(torch.zeros(1, 1), [1])
        with pytest.raises(ValueError, match="divisible"):
            t.reduce_scatter(torch.zeros(3, 1))
        return True

    assert run_threaded(bad, Topology(tp=2)) == [True, True]
    assert g.size == 1


def test_a_rank_that_raises_aborts_the_others_quickly():
    def fn(parallel):
        if parallel.rank == 1:
            raise ValueError("rank 1 failed before its collective")
        return parallel.groups["tp"].all_reduce(torch.ones(2))

    with pytest.raises(ValueError, match="rank 1 failed"):
        ThreadWorld(2, timeout=20).run(fn, Topology(tp=2))


def test_a_rank_that_never_joins_times_out_with_a_message():
    def fn(parallel):
        if parallel.rank == 0:
            return parallel.groups["tp"].all_reduce(torch.ones(2))
        return None  # rank 1 skips the collective

    with pytest.raises(CollectiveAborted, match="timed out.*did not join"):
        ThreadWorld(2, timeout=1).run(fn, Topology(tp=2))


def test_counting_collectives_counts_only_what_reaches_other_ranks():
    counter = CollectiveCounter()

    def fn(parallel):
        counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
        tp = counted.groups["tp"]
        tp.all_reduce(torch.ones(2))
        tp.all_reduce(torch.ones(0))
        counted.groups["pp"].all_reduce(torch.ones(2))  # size-one group
        return None

    run_threaded(fn, Topology(tp=2))
    assert counter.snapshot() == {"all_reduce@tp": 2}  # one per rank


def _one_rank_raises(parallel):
    import torch as _torch

    if parallel.rank == 1:
        raise ValueError("rank 1 broke before the collective")
    return parallel.groups["tp"].all_reduce(_torch.ones(1))


@pytest.mark.gloo
def test_a_rank_error_under_gloo_is_reported_not_a_timeout():
    from layer_boundary.launch import ProcessWorld, RankError

    world = ProcessWorld(2, timeout=60, collective_timeout=20)
    world.FAILURE_GRACE_S = 2.0
    try:
        with pytest.raises(RankError, match="rank 1 broke before the collective"):
            world.run(_one_rank_raises, Topology(tp=2))
    finally:
        world.close()
