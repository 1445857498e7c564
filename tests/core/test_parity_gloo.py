"""The same bit-exact parity under real gloo processes (every collective path at least once)."""

import pytest

from layer_boundary import Topology
from layer_boundary.testing.grid import GridSpec, run_grid_rank

from grid_cases import assert_matches_reference

pytestmark = pytest.mark.gloo

MIXED = GridSpec(
    stages=("attn", "ffn", "attn", "tail", "mixer", "mixer", "ffn", "mixer", "attn", "moe"), transforms=(0, 3), seed=5
)

CASES = [
    # (world, topology, dp_counts, kwargs)
    (2, Topology(tp=2), (5,), dict(policy="ar", captures=(0, 8))),
    (2, Topology(tp=2), (5,), dict(policy="rs+rsv", variant="sp", captures=(0, 8))),
    (2, Topology(tp=2), (6,), dict(policy="ar", variant="is")),
    (2, Topology(tp=2), (5,), dict(policy="ar", split=1)),
    (2, Topology(tp=2), (5,), dict(policy="ar", split=6)),
    (2, Topology(tp=2, attn_dp=2), (4, 1), dict(policy="ar")),
    (2, Topology(tp=2, attn_dp=2), (0, 3), dict(policy="rsv")),
    (2, Topology(tp=2, moe_ep=2), (4,), dict(policy="ar")),
    (4, Topology(tp=4, attn_dp=2), (5, 2), dict(policy="rs+rsv", padding="sum_len", captures=(0, 8))),
    (4, Topology(tp=4, attn_dp=2), (5, 2), dict(policy="rs+rsv", padding="max_len", split=4)),
    (4, Topology(tp=4, attn_dp=2), (3, 3), dict(policy="ar")),
    (4, Topology(tp=4), (7,), dict(policy="rs+rsv", variant="sp")),
]


@pytest.mark.parametrize("world, topology, counts, kwargs", CASES)
def test_grid_stack_matches_a_single_rank_under_gloo(gloo_world, world, topology, counts, kwargs):
    results = gloo_world(world).run(run_grid_rank, topology, MIXED, counts, **kwargs)
    assert_matches_reference(results, MIXED, topology, counts, captures=kwargs.get("captures", ()))
