"""On a machine without a GPU the plugin imports without flashinfer, declines every stage, and
keeps the provider contract; prepare then binds nothing and the model runs unfused."""

import subprocess
import sys
import textwrap

import pytest
import torch

from layer_boundary import Topology
from layer_boundary.testing.contract import ContractSettings
from layer_boundary.testing._contract.stages import stage_descriptions
from layer_boundary.testing.contract import contract_params
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.plugin import RECORD_NAME, build_provider

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_importing_the_plugin_and_its_modules_does_not_import_flashinfer():
    code = textwrap.dedent(
        """
        import sys
        import layer_boundary_flashinfer.plugin, layer_boundary_flashinfer.service
        import layer_boundary_flashinfer.backend, layer_boundary_flashinfer.provider, layer_boundary_flashinfer.workspace
        from layer_boundary.plugin import get_registry
        get_registry()
        print(sorted(m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@no_gpu
def test_the_factory_declines_every_stage_without_a_gpu():
    descriptions = stage_descriptions(ContractSettings())
    assert len(descriptions) > 30
    assert all(build_provider(d) is None for d in descriptions)


@pytest.mark.parametrize("case", contract_params(RECORD_NAME))
def test_flashinfer_record_keeps_the_provider_contract(case):
    case.run()


def _prepare_without_gpu(parallel):
    from flashinfer_fakes import model_logits, prompt_batches, tiny_model

    from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

    config, model = tiny_model("qwen3", parallel)
    prompts = prompt_batches(config)
    before = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model)  # the real FlashInfer backend: it must not be reached
    after = model_logits(model, parallel, prompts)
    return report, before, after


@no_gpu
def test_prepare_without_a_gpu_agrees_to_stay_unfused():
    for report, before, after in run_threaded(_prepare_without_gpu, Topology(tp=2), timeout=60):
        assert not report.available and not report.bound
        (group,) = report.groups
        assert group.action == "unavailable" and "provider is not attached" in group.reason
        assert all(torch.equal(a, b) for a, b in zip(before, after))
