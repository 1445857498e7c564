"""mHC arithmetic against Hugging Face's hyper-connection modules and against the formulas."""

import pytest
import torch

from layer_boundary_mhc.mapping import (
    collapse,
    expand,
    head_weights,
    independent_coefficients,
    independent_head_weights,
    inject,
    sinkhorn,
    stage_coefficients,
    write_back,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection, Glm5NextTextHyperHead  # noqa: E402
from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection, HYV4HyperHead  # noqa: E402

H = 32
DTYPES = [torch.float32, torch.float64]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randomize(fn, base, scale, seed):
    """Projections that give O(1) logits, non-zero biases, scales around 1."""
    g = _gen(seed)
    with torch.no_grad():
        fn.copy_(torch.randn(fn.shape, generator=g) / fn.shape[1] ** 0.5)
        base.copy_(0.5 * torch.randn(base.shape, generator=g))
        scale.copy_(1.0 + 0.1 * torch.randn(scale.shape, generator=g))


def _streams(T, n, dtype, seed=1):
    return torch.randn(T, n, H, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _deepseek(n, iters, dtype):
    cfg = transformers.DeepseekV4Config(
        hidden_size=H, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["sliding_attention"], mlp_layer_types=["moe"],
    )
    return cfg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, iters", [(4, 20), (3, 5)])
def test_stage_coefficients_and_collapse_equal_deepseek_v4(dtype, n, iters):
    hc = DeepseekV4HyperConnection(_deepseek(n, iters, dtype))
    _randomize(hc.fn, hc.base, hc.scale, seed=n)
    hc = hc.to(dtype)
    X = _streams(9, n, dtype)
    post, comb, collapsed = hc(X[None])
    ours = stage_coefficients(X, hc.fn, hc.base, hc.scale, iters=iters, eps=1e-6, rms_eps=1e-6)
    assert torch.equal(ours.post, post[0]) and torch.equal(ours.comb, comb[0])
    assert torch.equal(collapse(X, ours.pre), collapsed[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stage_coefficients_equal_glm5_next(dtype):
    cfg = transformers.Glm5NextTextConfig(hidden_size=H, hc_mult=3, hc_sinkhorn_iters=7, hc_eps=1e-6, rms_norm_eps=1e-5, num_hidden_layers=1)
    hc = Glm5NextTextHyperConnection(cfg)
    _randomize(hc.fn, hc.base, hc.scale, seed=11)
    hc = hc.to(dtype)
    X = _streams(6, 3, dtype, seed=2)
    post, comb, collapsed = hc(X[None])
    ours = stage_coefficients(X, hc.fn, hc.base, hc.scale, iters=7, eps=1e-6, rms_eps=1e-5)
    assert torch.equal(ours.post, post[0]) and torch.equal(ours.comb, comb[0])
    assert torch.equal(collapse(X, ours.pre), collapsed[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exit_contractions_equal_the_hf_heads(dtype):
    head = DeepseekV4HyperHead(_deepseek(4, 20, dtype))
    _randomize(head.hc_fn, head.hc_base, head.hc_scale, seed=5)
    head = head.to(dtype)
    X = _streams(7, 4, dtype, seed=3)
    weights = head_weights(X, head.hc_fn, head.hc_base, head.hc_scale, eps=1e-6, rms_eps=1e-6)
    assert torch.equal(collapse(X, weights), head(X[None])[0])
    assert torch.equal(X.mean(dim=1), Glm5NextTextHyperHead()(X[None])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_independent_hyper_connections_equal_hy_v4(dtype):
    """iHC: HF keeps the mapping in float32 and mixes in float32 whatever the activations are."""
    cfg = transformers.HYV4Config(hidden_size=H, hc_mult=3, hc_eps=1e-6, rms_norm_eps=1e-6, num_hidden_layers=1)
    hc, head = HYV4HyperConnection(cfg), HYV4HyperHead(cfg)
    _randomize(hc.fn, hc.base, hc.scale, seed=21)
    _randomize(head.hc_fn, head.hc_base, head.hc_scale, seed=22)
    X = _streams(8, 3, dtype, seed=6)
    post, collapsed = hc(X[None])
    pre, ours_post = independent_coefficients(X, hc.fn, hc.base, hc.scale, magnitude=cfg.hc_magnitude, eps=1e-6, rms_eps=1e-6)
    assert torch.equal(ours_post, post[0]) and torch.equal(collapse(X, pre), collapsed[0])
    weights = independent_head_weights(X, head.hc_fn, head.hc_base, head.hc_scale, eps=1e-6, rms_eps=1e-6)
    assert torch.equal(collapse(X, weights), head(X[None])[0])
    F = torch.randn(8, H, generator=_gen(8)).to(dtype)
    # HY-V4's decoder layer: X' = post F + X in float32, rounded once
    expected = (post[0].float().unsqueeze(-1) * F.float().unsqueeze(-2) + X.float()).to(dtype)
    assert torch.equal(inject(F, X, ours_post), expected)


def test_write_back_uses_comb_transposed():
    """X'[o] = post[o] F + sum_i comb[i, o] X[i], checked by loops on a non-symmetric comb."""
    n, T = 3, 4
    g = _gen(7)
    X = torch.randn(T, n, H, generator=g, dtype=torch.float64)
    F = torch.randn(T, H, generator=g, dtype=torch.float64)
    post = torch.rand(T, n, generator=g, dtype=torch.float64) * 2
    comb = sinkhorn(torch.randn(T, n, n, generator=g, dtype=torch.float64) * 2, 20, 1e-6)
    assert (comb - comb.transpose(-1, -2)).abs().max() > 0.05  # the orientation matters
    expected = torch.empty_like(X)
    for t in range(T):
        for o in range(n):
            expected[t, o] = post[t, o] * F[t] + sum(comb[t, i, o] * X[t, i] for i in range(n))
    torch.testing.assert_close(write_back(F, X, post, comb), expected, rtol=0, atol=1e-13)
    wrong = post[..., None] * F[:, None] + torch.matmul(comb, X)
    assert (wrong - expected).abs().max() > 1e-2


def test_sinkhorn_is_nearly_doubly_stochastic_and_not_symmetric():
    """20 iterations on O(1) logits (what a trained projection of unit-RMS rows gives)."""
    logits = torch.randn(50, 4, 4, generator=_gen(3))
    comb = sinkhorn(logits, 20, 1e-6)
    assert bool((comb > 0).all())
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(50, 4), rtol=0, atol=3e-6)  # the last step normalises columns
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(50, 4), rtol=0, atol=2e-5)
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2


def test_the_write_back_rounds_once_from_float32():
    """In bfloat16 the mix runs in float32 on bfloat16 inputs and float32 coefficients, rounded once."""
    n, T = 4, 5
    g = _gen(9)
    X = torch.randn(T, n, H, generator=g).bfloat16()
    F = torch.randn(T, H, generator=g).bfloat16()
    post = torch.rand(T, n, generator=g) * 2
    comb = sinkhorn(torch.randn(T, n, n, generator=g), 20, 1e-6)
    once = (post[..., None] * F.float()[:, None] + torch.matmul(comb.transpose(-1, -2), X.float())).bfloat16()
    ours = write_back(F, X, post, comb)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, once)
    y = collapse(X, post)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (post[..., None] * X.float()).sum(1).bfloat16())


def test_one_stream_degenerates_to_a_plain_residual():
    """n = 1, a zero projection and biases that open the gates: pre ~ 1, post = 1, comb ~ 1."""
    X = torch.randn(6, 1, H, generator=_gen(4), dtype=torch.float64)
    F = torch.randn(6, H, generator=_gen(5), dtype=torch.float64)
    fn = torch.zeros(3, H, dtype=torch.float64)
    base = torch.tensor([30.0, 0.0, 0.0], dtype=torch.float64)
    c = stage_coefficients(X, fn, base, torch.ones(3, dtype=torch.float64), iters=20, eps=1e-6, rms_eps=1e-6)
    torch.testing.assert_close(collapse(X, c.pre), X[:, 0], rtol=2e-6, atol=0)
    torch.testing.assert_close(write_back(F, X, c.post, c.comb)[:, 0], X[:, 0] + F, rtol=0, atol=1e-5)


def test_zero_rows_and_the_entry_expansion():
    fn, base, scale = torch.randn(24, 4 * H), torch.zeros(24), torch.ones(3)
    empty = expand(torch.zeros(0, H), 4)
    assert empty.shape == (0, 4, H)
    c = stage_coefficients(empty, fn, base, scale, iters=20, eps=1e-6, rms_eps=1e-6)
    assert c.pre.shape == (0, 4) and c.post.shape == (0, 4) and c.comb.shape == (0, 4, 4)
    assert collapse(empty, c.pre).shape == (0, H)
    assert write_back(torch.zeros(0, H), empty, c.post, c.comb).shape == (0, 4, H)
    x = torch.randn(3, H)
    assert torch.equal(expand(x, 4), x[:, None].repeat(1, 4, 1))
