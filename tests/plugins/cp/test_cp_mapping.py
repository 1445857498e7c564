"""The CP token mapping: the partition it describes, and its row moves bit-exact in the threaded
world (gather then return is the identity; reduce-scatter equals all-reduce then slice)."""

import pytest
import torch

from layer_boundary import BatchFactsError, Forward, Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_cp import TokenMapping, request_pieces

from cp_grid import planning_parallel

LENGTHS = [(), (0,), (1,), (2,), (7,), (5, 1, 7, 3), (9, 0, 4), (16, 8)]


def mappings(topology, lengths, order):
    return [TokenMapping(planning_parallel(topology, r), lengths, order=order) for r in range(topology.world_size)]


@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_every_row_belongs_to_exactly_one_cp_rank(lengths, cp, order):
    topology = Topology(tp=cp, attn_cp=cp)
    maps = mappings(topology, lengths, order)
    rows = torch.cat([m.local_index for m in maps])
    assert sorted(rows.tolist()) == list(range(sum(lengths)))
    for m in maps:
        assert m.counts == maps[0].counts and sum(m.counts) == sum(lengths)
        assert m.num_local == m.local_index.numel() == sum(m.request_counts)
        # local order: request after request, ascending inside each
        assert m.local_index.tolist() == sorted(m.local_index.tolist())
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        owner = [next(i for i in reversed(range(len(lengths))) if starts[i] <= row) for row in m.local_index.tolist()]
        assert [owner.count(i) for i in range(len(lengths))] == list(m.request_counts)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_pairs_pieces_for_balanced_causal_work(cp):
    """Rank r holds pieces r and 2cp-1-r: with a length divisible by 2cp every rank attends the
    same number of (query, key) pairs under a causal mask; contiguous gives the last rank most."""
    length = 2 * cp * 5
    work = {}
    for order in ("zigzag", "contiguous"):
        work[order] = [
            sum(offset + k + 1 for offset, count in pieces for k in range(count)) for pieces in request_pieces(length, cp, order)
        ]
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"] == sorted(work["contiguous"]) and work["contiguous"][0] < work["contiguous"][-1]
    assert request_pieces(length, cp, "zigzag")[0] == [(0, 5), ((2 * cp - 1) * 5, 5)]


def test_uneven_lengths_give_earlier_pieces_the_extra_token():
    assert request_pieces(7, 2, "contiguous") == [[(0, 4)], [(4, 3)]]
    assert request_pieces(7, 2, "zigzag") == [[(0, 2), (6, 1)], [(2, 2), (4, 2)]]
    assert request_pieces(1, 2, "zigzag") == [[(0, 1), (1, 0)], [(1, 0), (1, 0)]]
    with pytest.raises(ValueError, match="unknown CP token order 'ring'"):
        request_pieces(4, 2, "ring")


def _round_trip(parallel, lengths, order, seed):
    mapping = TokenMapping(parallel, lengths, order=order)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(mapping.total, 3, 2, generator=gen, dtype=torch.float64)  # the same on every rank
    local = mapping.take_local(full)
    gathered = mapping.gather(local)
    back = mapping.take_local(gathered)
    # full-row partial sums over TP: different on every rank
    partial = torch.randn(mapping.total, 5, generator=torch.Generator().manual_seed(seed + 1 + parallel.rank), dtype=torch.float64)
    scattered = mapping.reduce_scatter(partial.clone(), parallel.groups["tp"])
    reduced_then_taken = mapping.take_local(parallel.groups["tp"].all_reduce(partial.clone()))
    return full, local, gathered, back, scattered, reduced_then_taken


@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize(
    "topology",
    [Topology(tp=2, attn_cp=2), Topology(tp=4, attn_cp=2), Topology(tp=4, attn_cp=4), Topology(tp=6, attn_cp=3)],
    ids=["cp2", "cp2xtp2", "cp4", "cp3xtp2"],
)
@pytest.mark.parametrize("lengths", [(5, 1, 7, 3), (1,), (0, 2), (12,)], ids=str)
def test_moves_are_bit_exact(topology, lengths, order):
    for full, local, gathered, back, scattered, reduced_then_taken in run_threaded(_round_trip, topology, lengths, order, 11):
        assert torch.equal(gathered, full)  # return then gather: the identity on token-order rows
        assert torch.equal(back, local)  # gather then return: the identity on CP rows
        assert scattered.shape == reduced_then_taken.shape
        assert torch.equal(scattered, reduced_then_taken)  # reduce-scatter == all-reduce, then this rank's rows


def test_consecutive_rows_are_taken_as_a_view():
    topology = Topology(tp=2, attn_cp=2)
    full = torch.arange(10.0)
    first, second = mappings(topology, (10,), "contiguous")
    assert first.take_local(full).data_ptr() == full.data_ptr()
    assert torch.equal(second.take_local(full), full[5:])
    zig = mappings(topology, (10,), "zigzag")[0]
    assert zig.take_local(full).tolist() == [0, 1, 2, 8, 9]  # pieces of 3, 3, 2, 2


def test_a_mapping_that_does_not_fit_the_forward_is_rejected():
    topology = Topology(tp=2, attn_cp=2)
    parallel = planning_parallel(topology, 1)
    mapping = TokenMapping(parallel, (3, 4))
    with pytest.raises(BatchFactsError, match="covers 7 rows but the forward has num_tokens=6"):
        mapping.check(Forward(parallel, 6, cp=mapping))
    with pytest.raises(BatchFactsError, match="built for rank 1 of attn_cp=2, but this forward runs on rank 0"):
        mapping.check(Forward(planning_parallel(topology, 0), 7, cp=mapping))
    with pytest.raises(ValueError, match="needs the batch's 7 token-order rows, got 6"):
        mapping.take_local(torch.zeros(6))
    with pytest.raises(BatchFactsError, match="lengths must be >= 0"):
        TokenMapping(parallel, (3, -1))
