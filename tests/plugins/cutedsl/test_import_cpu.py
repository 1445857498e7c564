"""The plugin and its kernel API import on a CPU-only machine without importing cutlass."""

import subprocess
import sys
import textwrap


def test_plugin_import_does_not_import_cutlass():
    code = textwrap.dedent(
        """
        import sys
        before = {m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")}
        import layer_boundary_cutedsl.plugin
        import layer_boundary_cutedsl.kernels as k
        from layer_boundary_cutedsl.kernels import fused_add_rmsnorm, moe_finalize_add_rmsnorm
        after = {m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")}
        print(sorted(after - before))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_plugin_is_registered_by_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="layer_boundary")}
    assert names.get("cutedsl") == "layer_boundary_cutedsl.plugin"
