"""The flashinfer plugin's rope and decode-attention records on a machine without CUDA: they are
registered, their factories decline (so the reference models keep the torch path), and the rope
table holds the values the core's rotary embedding computes."""

import pytest
import torch

from layer_boundary import Parallel, prepare_model
from layer_boundary.plugin import DecodeAttentionRequest, RopeRequest, get_registry

pytest.importorskip("layer_boundary_flashinfer")

from layer_boundary_flashinfer import decode_kernels  # noqa: E402


def _requests(device="cpu", dtype=torch.bfloat16, head_dim=128):
    rope = RopeRequest(device=torch.device(device), dtype=dtype, head_dim=head_dim, heads=8, kv_heads=2, theta=1e6, max_positions=64)
    decode = DecodeAttentionRequest(device=torch.device(device), dtype=dtype, head_dim=head_dim, heads=8, kv_heads=2, scaling=head_dim**-0.5)
    return rope, decode


def test_records_are_registered_under_the_plugin():
    registry = get_registry()
    assert "flashinfer.rope" in [r.name for r in registry.rope_kernels]
    assert "flashinfer.decode_attention" in [r.name for r in registry.decode_attention_kernels]


@pytest.mark.parametrize(
    "device, dtype, head_dim, why",
    [("cpu", torch.bfloat16, 128, "a cpu device"), ("meta", torch.float32, 128, "a meta device")],
)
def test_factories_decline_without_cuda(device, dtype, head_dim, why):
    rope, decode = _requests(device, dtype, head_dim)
    assert decode_kernels.reason(rope) == why
    assert decode_kernels.rope_factory(rope) is None
    assert decode_kernels.decode_attention_factory(decode) is None


def test_reasons_name_dtype_and_head_dim():
    import attrs

    rope, _ = _requests()
    cuda = torch.device("cuda")
    assert decode_kernels.reason(attrs.evolve(rope, device=cuda, dtype=torch.float32)) == "torch.float32 rows"
    assert decode_kernels.reason(attrs.evolve(rope, device=cuda, head_dim=16)) == "head_dim 16"


def test_rope_table_is_the_cores_rotary_values():
    from layer_boundary_models.attention import RotaryEmbedding
    from layer_boundary.plugin import rope_cos_sin_table

    table = rope_cos_sin_table(128, 1e6, 64, "cpu")
    core = RotaryEmbedding(128, 1e6).table(64, torch.float32)  # [64, 2, 128]: cos, sin (each half repeated)
    assert table.shape == (64, 128) and table.dtype == torch.float32
    assert torch.allclose(table[:, :64], core[:, 0, :64], rtol=0, atol=1e-6)
    assert torch.allclose(table[:, 64:], core[:, 1, :64], rtol=0, atol=1e-6)


def test_a_cpu_model_keeps_the_torch_path_with_the_plugin_installed():
    from layer_boundary_models import build_model, model_config
    from layer_boundary_models.attention_kernels import TORCH

    model = build_model(model_config("qwen3"), Parallel.single(), dtype=torch.bfloat16)
    prepare_model(model, max_tokens=8)
    chosen = model.attention_kernels
    assert chosen.rope.name == TORCH and "flashinfer.rope" in chosen.rope.declined
    assert chosen.decode_attention.name == TORCH and "flashinfer.decode_attention" in chosen.decode_attention.declined


def test_the_tensor_core_kernel_is_planned_for_long_caches_and_large_batches():
    """The measured rule (decode_kernels.TENSOR_CORE_*): shape facts only, so every rank agrees."""
    assert not decode_kernels.uses_tensor_cores(1, 40) and not decode_kernels.uses_tensor_cores(1, 256)
    assert decode_kernels.uses_tensor_cores(1, 512) and decode_kernels.uses_tensor_cores(1, 1032)
    assert not decode_kernels.uses_tensor_cores(32, 40) and not decode_kernels.uses_tensor_cores(32, 128)
    assert decode_kernels.uses_tensor_cores(32, 256) and decode_kernels.uses_tensor_cores(8, 256)
    assert not decode_kernels.uses_tensor_cores(4, 256) and not decode_kernels.uses_tensor_cores(8, 255)
    # the tensor-core kernel runs without the split up to the longest cache timed
    assert not decode_kernels.splits_kv(1, 40) and not decode_kernels.splits_kv(32, 40)  # CUDA cores: a row is one page
    assert not decode_kernels.splits_kv(1, 511) and not decode_kernels.splits_kv(4, 300)
    assert not decode_kernels.splits_kv(1, 512) and not decode_kernels.splits_kv(32, 8200)
    assert decode_kernels.splits_kv(1, 8201) and decode_kernels.splits_kv(32, 32768)
