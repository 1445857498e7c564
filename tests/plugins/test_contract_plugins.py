"""Every record the installed plugins register keeps the provider contract (the built-in
plugin's too); CUDA cases run on the GPU machine."""

from pathlib import Path

import pytest

from layer_boundary.plugin import get_registry
from layer_boundary.testing.contract import contract_cases, contract_params

PLUGIN_FOLDERS = sorted(p.name for p in (Path(__file__).parents[2] / "plugins").iterdir() if (p / "pyproject.toml").is_file())

#: option sets for residual kinds whose factory needs options (kind record name -> list of kwargs)
RESIDUAL_OPTIONS: dict = {}


@pytest.mark.parametrize("case", contract_params(options=RESIDUAL_OPTIONS))
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
        records = [item.name for hook in ("fusion_providers", "residual_kinds", "adapters")
                   for item in registry.records(hook) if item.plugin == folder]
        assert records, f"plugin {folder!r} registers no record"
        assert set(records) <= covered
