"""The profile's timeline: idle stretches between kernels, named by the launches around them."""

from layer_boundary.bench.profile import timeline


def test_gaps_are_named_by_the_kernels_around_them_and_sorted():
    t = timeline([("gemm", 0.0, 10.0), ("norm", 12.0, 13.0), ("attn", 13.0, 20.0), ("head", 25.0, 30.0)])
    assert t["span_us"] == 30.0
    assert t["busy_us"] == 10.0 + 1.0 + 7.0 + 5.0
    assert t["idle_us"] == 7.0
    assert t["gaps"] == [["attn", "head", 5.0], ["gemm", "norm", 2.0]]


def test_overlapping_kernels_count_once_and_the_later_end_names_the_gap():
    # a PDL kernel starts before the one it depends on ends: the busy union counts the overlap once
    t = timeline([("norm", 5.0, 9.0), ("gemm", 0.0, 8.0), ("rope", 11.0, 12.0)])
    assert t["busy_us"] == 9.0 + 1.0
    assert t["idle_us"] == 2.0
    assert t["gaps"] == [["norm", "rope", 2.0]]


def test_a_kernel_inside_another_does_not_end_the_run():
    t = timeline([("long", 0.0, 10.0), ("short", 2.0, 3.0), ("next", 10.0, 11.0)])
    assert t["idle_us"] == 0.0 and t["gaps"] == []


def test_nothing_recorded():
    assert timeline([]) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
