"""TPAttention's one q/k/v GEMM: the fused weight holds exactly the rows the three
projections held (q sharded by rows over attention TP, k and v at `kv_rows()`, replicated
heads included), its output splits into the same q, k and v, and a quantized input goes
through `linear` with the module that owns the fused weight."""

import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary._layers import shard_rows
from layer_boundary._residual.quant import quantize_fp8
from layer_boundary.cli.plan_cmd import PlanningCollectives
from layer_boundary_models import model_config
from layer_boundary_models.attention import TPAttention


def _attention(tp: int, rank: int, dtype=torch.float64, device=None):
    parallel = Parallel.create(Topology(tp=tp), rank, lambda name, ranks: PlanningCollectives(name, ranks, rank))
    return TPAttention(model_config("qwen3"), parallel, 0, dtype=dtype, device=device)


def _full_weights(config, dtype=torch.float64, device=None):
    gen = torch.Generator().manual_seed(3)
    H, D = config.hidden_size, config.head_dim
    return tuple(torch.randn(n * D, H, generator=gen, dtype=dtype).to(device) for n in (config.num_heads, config.num_kv_heads, config.num_kv_heads))


# qwen3's preset has 4 heads and 2 KV heads: TP=2 shards the KV heads, TP=4 replicates them
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_load_qkv_fills_each_slice_with_the_rows_the_rank_owns(tp):
    config = model_config("qwen3")
    q_full, k_full, v_full = _full_weights(config)
    D = config.head_dim
    for rank in range(tp):
        attn = _attention(tp, rank)
        attn.load_qkv(q_full, k_full, v_full)
        q_rows, kv_rows = shard_rows(q_full, rank, tp), attn.kv_rows()
        if tp == 4:
            kv_head = rank // 2
            assert attn.kv_replicated and kv_rows == slice(kv_head * D, (kv_head + 1) * D)
        want = torch.cat((q_rows, k_full[kv_rows], v_full[kv_rows]))
        assert torch.equal(attn.qkv_proj.weight, want)

        x = torch.randn(5, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        q, k, v = attn._qkv(x)
        assert q.shape == (5, attn.heads, D) and k.shape == v.shape == (5, attn.kv_heads, D)
        # float64: the fused GEMM's slices are the three GEMMs' results
        torch.testing.assert_close(q.reshape(5, -1), x @ q_rows.T, rtol=0, atol=1e-12)
        torch.testing.assert_close(k.reshape(5, -1), x @ k_full[kv_rows].T, rtol=0, atol=1e-12)
        torch.testing.assert_close(v.reshape(5, -1), x @ v_full[kv_rows].T, rtol=0, atol=1e-12)


def test_addends_add_their_delta_to_their_slice_only():
    attn = _attention(1, 0)
    attn.load_qkv(*_full_weights(model_config("qwen3")))
    x = torch.randn(3, attn.qkv_proj.in_features, dtype=torch.float64)
    base = attn._qkv(x)
    attn.k_addend = torch.nn.Linear(attn.qkv_proj.in_features, attn.kv_width, bias=False, dtype=torch.float64)
    q, k, v = attn._qkv(x)
    assert torch.equal(q, base[0]) and torch.equal(v, base[2])
    assert torch.equal(k, (base[1].reshape(3, -1) + attn.k_addend(x)).view_as(k))


def test_an_fp8_input_projects_through_the_fused_module():
    """On the CPU the quantized input is dequantized (the reference path): the same q, k, v as
    the dequantized tensor, through one call of the fused projection."""
    attn = _attention(2, 1, dtype=torch.bfloat16)
    attn.load_qkv(*_full_weights(model_config("qwen3"), dtype=torch.bfloat16))
    x = quantize_fp8(torch.randn(4, attn.qkv_proj.in_features), torch.bfloat16, None)
    calls = []
    attn.qkv_proj.register_forward_hook(lambda module, args, out: calls.append(type(args[0]).__name__))
    got = attn._qkv(x)
    want = attn._qkv(x.dequantize(torch.bfloat16))
    assert calls == ["Fp8Input", "Tensor"]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 GEMM (torch._scaled_mm) runs on CUDA only")
def test_an_fp8_input_on_cuda_quantizes_the_fused_weight_once():
    attn = _attention(1, 0, dtype=torch.bfloat16, device="cuda")
    attn.load_qkv(*_full_weights(model_config("qwen3"), dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(8, attn.qkv_proj.in_features, device="cuda")
    fp8 = quantize_fp8(x, torch.bfloat16, None)
    got = attn._qkv(fp8)
    cached = attn.qkv_proj._fp8_weight
    assert cached[0] is attn.qkv_proj.weight
    attn._qkv(fp8)
    assert attn.qkv_proj._fp8_weight is cached  # quantized once, reused
    want = attn._qkv(x.to(torch.bfloat16))
    for a, b in zip(got, want):  # two E4M3 roundings (input, weight): a few percent of the scale
        torch.testing.assert_close(a.float(), b.float(), rtol=0.1, atol=0.15 * b.float().abs().amax().item())
