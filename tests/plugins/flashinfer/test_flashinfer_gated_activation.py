"""The flashinfer plugin's gated-activation record on a machine without CUDA: registered, its
factory declines (so the gated MLPs keep the torch path) with a reason for each rule, the
FlashInfer functions it calls exist with the signature it calls them by, and the custom op's
fake implementation gives torch.compile the output's shape."""

import inspect

import attrs
import pytest
import torch

from layer_boundary import Parallel, prepare_model
from layer_boundary.plugin import GatedActivationRequest, get_registry

pytest.importorskip("layer_boundary_flashinfer")

from layer_boundary_flashinfer import gated_activation  # noqa: E402


def _request(device="cpu", dtype=torch.bfloat16, activation="silu", intermediate=256):
    return GatedActivationRequest(device=torch.device(device), dtype=dtype, activation=activation, intermediate=intermediate)


def test_the_record_is_registered_under_the_plugin():
    assert "flashinfer.gated_activation" in [r.name for r in get_registry().gated_activation_kernels]


@pytest.mark.parametrize("device, why", [("cpu", "a cpu device"), ("meta", "a meta device")])
def test_the_factory_declines_without_cuda(device, why):
    request = _request(device)
    assert gated_activation.reason(request) == why
    assert gated_activation.gated_activation_factory(request) is None


def test_reasons_name_dtype_activation_switch_and_library(monkeypatch):
    cuda = _request("cuda")
    assert gated_activation.reason(attrs.evolve(cuda, dtype=torch.float32)) == "torch.float32 rows"
    assert gated_activation.reason(attrs.evolve(cuda, activation="relu2")) == "activation 'relu2'"
    monkeypatch.setenv("LAYER_BOUNDARY_FLASHINFER", "0")
    assert gated_activation.reason(cuda) == "LAYER_BOUNDARY_FLASHINFER=0"
    monkeypatch.delenv("LAYER_BOUNDARY_FLASHINFER")
    from layer_boundary_flashinfer import eligibility

    monkeypatch.setattr(eligibility, "flashinfer_installed", lambda: False)
    assert gated_activation.reason(cuda) == "flashinfer-python missing"
    monkeypatch.setattr(eligibility, "flashinfer_installed", lambda: True)
    assert gated_activation.reason(cuda) is None


def test_the_flashinfer_functions_exist_with_the_signature_called():
    activation = pytest.importorskip("flashinfer.activation")
    for name in gated_activation.FUNCTIONS.values():
        parameters = list(inspect.signature(getattr(activation, name)).parameters)
        assert parameters[0] == "input" and "enable_pdl" in parameters, (name, parameters)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fake_gives_half_the_last_dim(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gate_up = torch.empty(7, 2 * 96, dtype=dtype)
        out = torch.ops.layer_boundary_flashinfer.gated_activation(gate_up, "silu", True)
    assert out.shape == (7, 96) and out.dtype == dtype


def test_a_cpu_model_keeps_the_torch_path_with_the_plugin_installed():
    from layer_boundary_models import build_model, model_config
    from layer_boundary_models.kernel_choice import TORCH

    model = build_model(model_config("qwen3"), Parallel.single(), dtype=torch.bfloat16)
    prepare_model(model, max_tokens=8)
    (choice,) = model.mlp_kernels.values()
    assert choice.name == TORCH and "flashinfer.gated_activation" in choice.declined
    assert model.layers[0].mlp.gated_activation_kernel is None
