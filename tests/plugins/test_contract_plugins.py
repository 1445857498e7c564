"""Every record the installed plugins register keeps the provider contract (the built-in
plugin's too); CUDA cases run on the GPU machine."""

from pathlib import Path

import pytest

from layer_boundary.testing.contract import ContractSettings

from layer_boundary.plugin import get_registry
from layer_boundary._plugins.manager import HOOKS
from layer_boundary.testing.contract import contract_cases, contract_params

PLUGIN_FOLDERS = sorted(p.name for p in (Path(__file__).parents[2] / "plugins").iterdir() if (p / "pyproject.toml").is_file())

#: option sets for residual kinds whose factory needs options (kind record name -> list of kwargs)
def _hc_mapping(rows, scales, seed, n=3, hidden=None):
    """A hyper-connection mapping (mhc/ihc) for the contract's hidden size."""
    import types

    import torch

    from layer_boundary.testing.contract import ContractSettings

    hidden = hidden or ContractSettings().hidden_size
    g = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(
        fn=torch.randn(rows, n * hidden, generator=g, dtype=torch.float64) / (n * hidden) ** 0.5,
        base=0.5 * torch.randn(rows, generator=g, dtype=torch.float64),
        scale=1.0 + 0.1 * torch.randn(scales, generator=g, dtype=torch.float64),
    )


#: residual kinds that need construction options (per record name: a list of option sets)
RESIDUAL_OPTIONS: dict = {
    "mhc.torch": [dict(streams=3, attn=_hc_mapping(15, 3, 1), ffn=_hc_mapping(15, 3, 2), head=_hc_mapping(3, 1, 3))],
    "mhc.ihc_torch": [dict(streams=3, attn=_hc_mapping(6, 2, 1), ffn=_hc_mapping(6, 2, 2), head=_hc_mapping(3, 1, 3))],
}


#: hyper-connection kinds compute their mappings in float32 (as HF does), which is not batch-
#: invariant: their float64 laws hold to float32 rounding, so they run with that tolerance
HC_KINDS = tuple(RESIDUAL_OPTIONS)
HC_SETTINGS = ContractSettings(tolerances=(("float64", 1e-6), ("float32", 1e-5), ("bfloat16", 2e-2), ("float16", 4e-3)))


def _params():
    registry = get_registry()
    names = [r.name for hook in HOOKS for r in registry.records(hook)]
    plain = [n for n in names if n not in HC_KINDS]
    hc = [n for n in names if n in HC_KINDS]
    return contract_params(*plain, options=RESIDUAL_OPTIONS) + (contract_params(*hc, options=RESIDUAL_OPTIONS, settings=HC_SETTINGS) if hc else [])


@pytest.mark.parametrize("case", _params())
def test_registered_records_keep_the_provider_contract(case):
    report = case.run()
    if case.name == "core.unfused" and case.check == "parity":
        assert report.stats["cases_accepted"] > 0  # the reference itself ran on every case
    if case.name == "core.plain" and case.check == "parity":
        assert report.stats["laws_checked"] > 0


def test_every_plugin_folder_is_covered():
    registry = get_registry()
    covered = {case.name for case in contract_cases(devices=("cpu",))}
    for folder in PLUGIN_FOLDERS:
        report = registry.plugin(folder)
        assert report is not None and report.ok, f"plugin {folder!r} is not installed or failed to load: {report}"
        records = [item.name for hook in HOOKS for item in registry.records(hook) if item.plugin == folder]
        assert records, f"plugin {folder!r} registers no record"
        assert set(records) <= covered
