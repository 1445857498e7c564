import pytest

from layer_boundary import Topology, TopologyError
from layer_boundary.testing.threaded import run_threaded

from collective_cases import group_layout


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=4, attn_dp=3), "not divisible by attn_dp"),
        (dict(tp=4, attn_tp=3), "tp must be divisible by attn_tp"),
        (dict(tp=4, attn_dp=2, attn_tp=4), "tp=4 must equal attn_dp"),
        (dict(tp=6, moe_ep=4), "not divisible by moe_ep"),
        (dict(tp=4, moe_ep=2, moe_tp=4), "moe_ep\\*moe_tp"),
        (dict(tp=0), "positive integer"),
        (dict(tp=2, pp=-1), "positive integer"),
    ],
)
def test_invalid_sizes_name_the_fix(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)


def test_defaults_fill_in_attn_tp_and_moe_tp():
    t = Topology(tp=8, attn_dp=2, attn_cp=2, moe_ep=4)
    assert (t.attn_tp, t.moe_tp, t.world_size) == (2, 2, 8)


def test_rank_coordinates_and_groups():
    t = Topology(tp=4, attn_dp=2, moe_ep=2, pp=2)
    assert t.coordinates(5) == {"pp": 1, "tp": 1, "attn_tp": 1, "attn_cp": 0, "attn_dp": 0, "moe_ep": 0, "moe_tp": 1}
    groups = t.groups()
    assert groups["attn_tp"][0] == (0, 1) and groups["attn_dp"][0] == (0, 2)
    assert groups["pp"][0] == (0, 4)
    with pytest.raises(TopologyError, match="outside a world of 8"):
        t.coordinates(8)


def test_every_rank_sees_consistent_groups():
    t = Topology(tp=4, attn_dp=2)
    layouts = run_threaded(group_layout, t)
    for rank, layout in enumerate(layouts):
        for name, (size, grank, ranks) in layout.items():
            assert ranks[grank] == rank
            assert size == len(ranks)
