"""The cutedsl plugin's model-wide kernel records (q/k norm + rope, gated activation) on a CPU
machine: registered as public hooks, and their factories decline with the reason, first the
device, then the dtype, then the kernel's own shape limits."""

import torch

from layer_boundary.plugin import GatedActivationRequest, QKNormRopeRequest
from layer_boundary_cutedsl import gated_activation_kernel, plugin, qk_norm_rope_kernel


def _qk(**kw):
    fields = dict(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, heads=32, kv_heads=8, theta=1e6,
                  max_positions=4096, eps=1e-6)
    fields.update(kw)
    return QKNormRopeRequest(**fields)


def _gated(**kw):
    fields = dict(device=torch.device("cuda"), dtype=torch.bfloat16, activation="silu", intermediate=1536)
    fields.update(kw)
    return GatedActivationRequest(**fields)


def test_the_records_are_the_plugins_hooks():
    (qk,) = plugin.layer_boundary_qk_norm_rope_kernels()
    (gated,) = plugin.layer_boundary_gated_activation_kernels()
    assert (qk.name, gated.name) == ("cutedsl.qk_norm_rope", "cutedsl.gated_activation")
    assert qk.factory(_qk(device=torch.device("cpu"))) is None and gated.factory(_gated(device=torch.device("cpu"))) is None


def test_the_reasons_name_what_the_kernel_cannot_run():
    assert qk_norm_rope_kernel.reason(_qk(device=torch.device("cpu"))) == "a cpu device"
    assert qk_norm_rope_kernel.reason(_qk(dtype=torch.float32)) == "torch.float32"
    assert qk_norm_rope_kernel.reason(_qk(head_dim=96)) == "head_dim 96"
    assert gated_activation_kernel.reason(_gated(activation="relu2")) == "activation 'relu2'"
    assert gated_activation_kernel.reason(_gated(intermediate=12)) == "width 12"
    assert gated_activation_kernel.reason(_gated(device=torch.device("meta"))) == "a meta device"
    if not torch.cuda.is_available():  # everything else fits: only the missing GPU is left
        assert qk_norm_rope_kernel.reason(_qk()) == "nvidia-cutlass-dsl or CUDA missing"
        assert gated_activation_kernel.reason(_gated()) == "nvidia-cutlass-dsl or CUDA missing"


def test_debug_mode_refuses_positions_past_the_rope_table_before_any_launch(monkeypatch):
    """The kernel reads table[position] unchecked; LAYER_BOUNDARY_DEBUG checks on the host first
    (here on CPU tensors: the error comes before any compile or launch)."""
    import pytest

    from layer_boundary_cutedsl.kernels import _launch
    from layer_boundary.plugin import rope_cos_sin_table
    from layer_boundary_cutedsl.kernels.qk_norm_rope import fused_qk_norm_rope

    monkeypatch.setattr(_launch, "DEBUG", True)
    q, k = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    table = rope_cos_sin_table(64, 1e4, 16, "cpu")
    with pytest.raises(ValueError, match=r"positions span 3\.\.16 but the table covers 0\.\.15"):
        fused_qk_norm_rope(q, k, torch.tensor([3, 16]), w, w, table, 1e-6)
    with pytest.raises(ValueError, match="positions span -1"):
        fused_qk_norm_rope(q, k, torch.tensor([-1, 2]), w, w, table, 1e-6)


def test_inputs_on_another_device_and_odd_widths_are_refused_with_the_fix():
    """A weight, table or positions tensor on another device than q would be dereferenced as a
    device address: refused first. A gate_up width that is not 2 x whole vectors is refused on
    every call (a cached entry of the width below would read misaligned rows)."""
    import pytest

    from layer_boundary_cutedsl.kernels.gated_activation import gated_activation
    from layer_boundary.plugin import rope_cos_sin_table
    from layer_boundary_cutedsl.kernels.qk_norm_rope import fused_qk_norm_rope

    q, k = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    table = rope_cos_sin_table(64, 1e4, 16, "cpu")
    positions = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="q_weight must be .* on cpu, got .* on meta"):
        fused_qk_norm_rope(q, k, positions, w.to("meta"), w, table, 1e-6)
    with pytest.raises(ValueError, match="table must be .* on cpu"):
        fused_qk_norm_rope(q, k, positions, w, w, table.to("meta"), 1e-6)
    with pytest.raises(ValueError, match="positions must be int64 .* on cpu"):
        fused_qk_norm_rope(q, k, positions.to("meta"), w, w, table, 1e-6)
    with pytest.raises(ValueError, match="multiple of 8"):
        gated_activation(torch.zeros(3, 2 * 16 + 2, dtype=torch.bfloat16))
