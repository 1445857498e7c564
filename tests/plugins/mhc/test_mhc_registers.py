"""The mhc plugin loads through its entry point and registers records under its prefix."""

from layer_boundary.plugin import get_registry, reset_registry


def test_mhc_plugin_loads_and_registers():
    reset_registry()
    registry = get_registry()
    report = registry.plugin("mhc")
    assert report is not None and report.ok, report
    assert report.distribution == "layer-boundary-mhc"
    names = [r.name for hook in ("fusion_providers", "residual_kinds", "adapters") for r in registry.records(hook) if r.plugin == "mhc"]
    assert names and all(name.startswith("mhc.") for name in names)
