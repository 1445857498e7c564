"""The cutedsl plugin's life cycle is the core's: `prepare_model` installs the model's service
(`install_cutedsl_fusion`) and prepares it, `release_model` drops its workspace."""

import torch

from layer_boundary import Forward, Parallel, prepare_model, release_model
from layer_boundary.testing.grid import GridModel, GridSpec, grid_inputs, reference
from layer_boundary_cutedsl import CuteDSLFusion, CuteDSLService
from layer_boundary_cutedsl.testing import reference_kernels

SPEC = GridSpec(stages=("attn", "moe", "attn", "ffn", "attn", "moe"), hidden=16, top_k=2, experts=4)


def test_prepare_model_installs_and_prepares_the_service_and_release_drops_it():
    calls = []
    fusion = CuteDSLFusion(kernels=reference_kernels(calls))
    model = GridModel(SPEC, Parallel.single(), fusions=fusion)
    assert fusion.service is None
    assert "cutedsl" in prepare_model(model, max_tokens=8)
    service = fusion.service
    assert isinstance(service, CuteDSLService) and service.max_tokens == 8 and service.usable
    x = grid_inputs(SPEC, [5])[0]
    out = model.run(x, Forward(Parallel.single(), 5))
    assert "moe_finalize_add_rmsnorm" in [c[0] for c in calls]  # the prepared service let the MoE defer
    assert torch.allclose(out, reference(SPEC, grid_inputs(SPEC, [5]))[0][0], rtol=1e-12, atol=1e-12)
    assert "cutedsl" in release_model(model)
    assert service.max_tokens is None and not service.usable and not service.supports(5)
    prepare_model(model, max_tokens=8)  # again: the installed service is prepared again, not replaced
    assert fusion.service is service and service.supports(5)


def test_a_model_without_the_provider_is_left_alone():
    model = GridModel(SPEC, Parallel.single())
    assert "cutedsl" in prepare_model(model, max_tokens=8)  # the hook ran, and found nothing to do
    assert not any(isinstance(p, CuteDSLFusion) for b in model.boundaries for p, _ in b.plan.providers)
