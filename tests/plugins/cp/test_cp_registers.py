"""The cp plugin loads through its entry point and registers records under its prefix."""

from layer_boundary.testing import assert_plugin_registers


def test_cp_plugin_loads_and_registers():
    assert_plugin_registers("cp")
