"""What a stage's compute input may be: a tensor, a tuple of row tensors (a read that prepares
several inputs, such as two norms of one residual), or an object with `map_rows`. Under sequence
parallelism and attention DP the boundary moves each part's rows; anything else is a clear error."""

import pytest
import torch

from layer_boundary import Forward, RMSNorm, Topology, declare_attn, declare_ffn, make_stages, residual_batch
from layer_boundary import ResidualOps
from layer_boundary._residual.add_norm import PLAIN_ADD
from layer_boundary.testing import run_threaded

H = 8


class TwoNorms:
    """A read returning (norm(r), 2 * norm(r)): two compute inputs with the residual's rows."""

    plain_norm = False
    before_gather = True

    def enter(self, hidden):
        return hidden

    def read(self, residual, norm):
        normed = norm(residual)
        return (normed, 2 * normed), residual

    def update_and_read(self, update, contribution, residual, norm):
        return self.read(update.apply(contribution, residual), norm)


class Opaque:
    """A read returning something the boundary cannot move."""

    plain_norm = False
    before_gather = True

    def enter(self, hidden):
        return hidden

    def read(self, residual, norm):
        return {"rows": norm(residual)}, residual

    def update_and_read(self, update, contribution, residual, norm):
        return self.read(update.apply(contribution, residual), norm)


def _ops(read):
    return ResidualOps(name="two", attn_read=read, attn_update=PLAIN_ADD, ffn_read=read, ffn_update=PLAIN_ADD)


def _layer(parallel, read, tokens, **facts):
    g = torch.Generator().manual_seed(0)  # each rank its own: threads share torch's default generator
    norms = [RMSNorm(H, dtype=torch.float64) for _ in range(2)]
    ops = _ops(read)
    attn, ffn = make_stages((declare_attn(residual=ops), norms[0]), (declare_ffn(residual=ops), norms[1]), terminal=True, parallel=parallel)
    x = torch.randn(tokens, H, dtype=torch.float64, generator=g)
    fwd = Forward(parallel, tokens, **facts)
    residual_batch.start(fwd)
    a, b = attn.prepare(x, fwd)
    assert a.shape[0] == tokens  # the attention sees every row, each part gathered
    group = parallel.groups["attn_tp"]
    out = attn.finish((a + b) / group.size, fwd)  # a partial whose sum over attention TP is a + b
    a, b = ffn.prepare(out, fwd)
    with ffn.exit(fwd) as scope:
        y = a * b
    return residual_batch.norm(scope.finish(y), fwd, RMSNorm(H, dtype=torch.float64))


def test_a_tuple_input_moves_part_by_part_under_sequence_parallelism():
    single = run_threaded(lambda p: _layer(p, TwoNorms(), 5), Topology())[0]
    for out in run_threaded(lambda p: _layer(p, TwoNorms(), 5, sequence_parallel=True), Topology(tp=2)):
        assert torch.allclose(out, single, rtol=0, atol=1e-12)


def test_an_input_the_boundary_cannot_move_names_what_a_read_may_return():
    with pytest.raises(TypeError, match="a read must return a tensor .rows, ...., a tuple of them, or an object with map_rows"):
        run_threaded(lambda p: _layer(p, Opaque(), 5, sequence_parallel=True), Topology(tp=2))
