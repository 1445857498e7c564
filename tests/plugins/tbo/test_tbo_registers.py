"""The tbo plugin loads through its entry point and registers records under its prefix."""

from layer_boundary.plugin import get_registry, reset_registry


def test_tbo_plugin_loads_and_registers():
    reset_registry()
    registry = get_registry()
    report = registry.plugin("tbo")
    assert report is not None and report.ok, report
    assert report.distribution == "layer-boundary-tbo"
    names = [r.name for hook in ("fusion_providers", "residual_kinds", "adapters") for r in registry.records(hook) if r.plugin == "tbo"]
    assert names and all(name.startswith("tbo.") for name in names)
