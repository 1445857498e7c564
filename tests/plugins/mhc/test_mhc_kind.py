"""The mhc residual kind's record, options, capabilities and errors."""

import re
from types import SimpleNamespace

import pytest
import torch

from layer_boundary import (
    Forward,
    Messages,
    MissingPluginError,
    Parallel,
    RMSNorm,
    ResidualOps,
    declare_attn,
    declare_ffn,
    get_registry,
    make_stages,
    residual_batch,
    residual_kind,
)
from layer_boundary.plugin import reset_registry

H, N = 8, 3


def _mapping(rows, scales, seed=0, hidden=H):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        fn=torch.randn(rows, N * hidden, generator=g, dtype=torch.float64) / (N * hidden) ** 0.5,
        base=0.5 * torch.randn(rows, generator=g, dtype=torch.float64),
        scale=1.0 + 0.1 * torch.randn(scales, generator=g, dtype=torch.float64),
    )


def _ops(**overrides):
    options = dict(streams=N, attn=_mapping((2 + N) * N, 3, 1), ffn=_mapping((2 + N) * N, 3, 2), head=_mapping(N, 1, 3))
    options.update(overrides)
    return residual_kind("mhc", **options)


def _norm():
    return RMSNorm(H, dtype=torch.float64, compute_dtype=torch.float64)


def test_the_record_and_the_declared_capabilities():
    (record,) = get_registry().residual_kinds_of("mhc")
    assert record.name == "mhc.torch" and record.distribution == "layer-boundary-mhc"
    ops = _ops()
    assert isinstance(ops, ResidualOps) and ops.name == "mhc.torch" and ops.supports_slices
    for update in (ops.attn_update, ops.ffn_update):
        assert update.plain_add is False and update.at_producer is False
    for read in (ops.attn_read, ops.ffn_read, ops.final_read):
        assert read.plain_norm is False
    decl = declare_ffn(residual=ops)
    assert decl.residual == "mhc.torch" and "mhc.torch" in decl.describe()


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(streams=0), ValueError, "streams >= 1"),
        (dict(sinkhorn_iters=0), ValueError, "sinkhorn_iters >= 1"),
        (dict(attn=SimpleNamespace(fn=torch.zeros(15, 24))), TypeError, "has no tensor 'base'"),
        (dict(ffn=_mapping(14, 3)), ValueError, "mhc ffn mapping: fn has shape (14, 24), expected [15, 3 * hidden]"),
        (dict(head=_mapping(N, 2)), ValueError, "mhc head mapping: scale has shape (2,), expected [1]"),
        (dict(attn=_mapping(15, 3, hidden=4)), ValueError, "disagree on the hidden size"),
    ],
)
def test_bad_options_name_the_problem(overrides, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _ops(**overrides)


def test_read_and_update_follow_the_formulas_including_zero_rows():
    ops = _ops()
    norm = _norm()
    for T in (5, 0):
        x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        streams = ops.attn_read.enter(x)
        assert torch.equal(streams, x[:, None].expand(T, N, H))
        inp, residual = ops.attn_read.read(streams, norm)
        kept, post, comb = residual
        assert kept is streams and post.shape == (T, N) and comb.shape == (T, N, N)
        # pre is recomputed here from the same mapping; the read's input is norm(sum_i pre_i X_i)
        m = ops.attn_read.mapping
        flat = streams.reshape(T, N * H).float()
        mix = (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)) @ m.fn.float().T
        pre = torch.sigmoid((mix[:, :N] * m.scale[0].float()).double() + m.base[:N]) + 1e-6
        assert torch.equal(inp, norm((pre[..., None] * streams).sum(1)))
        F = torch.randn(T, H, dtype=torch.float64)
        new = ops.attn_update.apply(F, residual)
        want = post[..., None] * F[:, None] + torch.einsum("tio,tih->toh", comb, streams)
        torch.testing.assert_close(new, want, rtol=0, atol=1e-13)
        normed, exit_streams = ops.final_read.update_and_read(ops.ffn_update, F, residual, norm)
        assert normed.shape == (T, H) and torch.equal(exit_streams, new)


def test_an_update_without_coefficients_is_refused():
    ops = _ops()
    with pytest.raises(ValueError, match="needs the coefficients its stage's read left"):
        ops.ffn_update.apply(torch.zeros(2, H), torch.zeros(2, N, H))
    streams = torch.zeros(3, N, H)
    _, residual = ops.attn_read.read(streams, _norm().float())
    with pytest.raises(ValueError, match="the output has 2 rows but the residual 3"):
        ops.attn_update.apply(torch.zeros(2, H), residual)


def _one_layer(parallel):
    ops = _ops()
    attn, ffn = make_stages((declare_attn(residual=ops), _norm()), (declare_ffn(residual=ops), _norm()), terminal=True, parallel=parallel)
    return ops, attn, ffn


def test_snapshot_refuses_and_norm_needs_the_final_read():
    parallel = Parallel.single()
    ops, attn, ffn = _one_layer(parallel)
    fwd = Forward(parallel, 4)
    residual_batch.start(fwd)
    x = torch.randn(4, H, dtype=torch.float64)
    h = attn.finish(attn.prepare(x, fwd), fwd)
    with pytest.raises(NotImplementedError, match=Messages.SNAPSHOT_PLAIN):
        residual_batch.snapshot(h, fwd)
    inp = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        y = inp * 0.5
    h = out.finish(y)
    with pytest.raises(ValueError, match="pass|final_read"):
        residual_batch.norm(h, fwd, _norm())
    assert residual_batch.norm(h, fwd, _norm(), final_read=ops.final_read).shape == (4, H)


def test_without_the_plugin_asking_for_mhc_names_the_distribution(monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "mhc")
    reset_registry()
    try:
        with pytest.raises(MissingPluginError, match="layer-boundary-mhc") as info:
            _ops()
        assert info.value.distribution == "layer-boundary-mhc"
    finally:
        monkeypatch.delenv("LAYER_BOUNDARY_DISABLE_PLUGINS")
        reset_registry()


def test_the_ihc_kind_shares_the_contract():
    (record,) = get_registry().residual_kinds_of("ihc")
    assert record.name == "mhc.ihc_torch" and record.distribution == "layer-boundary-mhc"
    ops = residual_kind("ihc", streams=N, attn=_mapping(2 * N, 2, 1), ffn=_mapping(2 * N, 2, 2))
    assert ops.attn_update.plain_add is False and ops.ffn_read.plain_norm is False
    with pytest.raises(ValueError, match=re.escape("ihc attn mapping: fn has shape (15, 24), expected [6, 3 * hidden]")):
        residual_kind("ihc", streams=N, attn=_mapping(15, 3), ffn=_mapping(2 * N, 2))
    streams = torch.randn(4, N, H, dtype=torch.float64)
    _, residual = ops.attn_read.read(streams, _norm())
    with pytest.raises(ValueError, match="an ihc update needs the coefficients"):
        ops.attn_update.apply(torch.zeros(4, H, dtype=torch.float64), residual + (None,))
    F = torch.randn(4, H, dtype=torch.float64)
    torch.testing.assert_close(ops.attn_update.apply(F, residual), residual[1][..., None] * F[:, None] + streams, rtol=0, atol=1e-14)
    normed, _ = ops.final_read.read(streams, _norm())  # no head: the streams' mean
    torch.testing.assert_close(normed, _norm()(streams.mean(1)), rtol=0, atol=0)


def _through_one_layer(parallel, ops, attn, ffn, x):
    fwd = Forward(parallel, x.shape[0])
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(x, fwd), fwd)
    inp = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        y = inp * 0.5
    return fwd, out.finish(y)


def test_the_final_read_in_every_stream_state():
    """Pending (update, then contract + norm), written (after fold) and initial (an empty stack)
    all leave through the kind's exit read; fold-then-norm equals norm of the pending output."""
    parallel = Parallel.single()
    ops, attn, ffn = _one_layer(parallel)
    final, x = _norm(), torch.randn(5, H, dtype=torch.float64)
    fwd, h = _through_one_layer(parallel, ops, attn, ffn, x)
    pending = residual_batch.norm(h, fwd, final, final_read=ops.final_read)
    fwd, h = _through_one_layer(parallel, ops, attn, ffn, x)
    folded = residual_batch.fold(h, fwd)
    assert folded.shape == (5, N, H)
    assert torch.equal(residual_batch.norm(folded, fwd, final, final_read=ops.final_read), pending)
    fwd = Forward(parallel, 5)
    residual_batch.start(fwd)
    empty_stack = residual_batch.norm(x, fwd, final, final_read=ops.final_read)
    assert torch.equal(empty_stack, ops.final_read.read(ops.final_read.enter(x), final)[0])
