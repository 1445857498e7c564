"""The lora plugin loads through its entry point and registers records under its prefix."""

from layer_boundary.plugin import get_registry, reset_registry


def test_lora_plugin_loads_and_registers():
    reset_registry()
    registry = get_registry()
    report = registry.plugin("lora")
    assert report is not None and report.ok, report
    assert report.distribution == "layer-boundary-lora"
    names = [r.name for hook in ("fusion_providers", "residual_kinds", "adapters") for r in registry.records(hook) if r.plugin == "lora"]
    assert names and all(name.startswith("lora.") for name in names)
