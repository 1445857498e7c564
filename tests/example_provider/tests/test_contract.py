"""The example's own tests: the provider contract suite, as a plugin author runs it."""

from pathlib import Path

import pytest

from layer_boundary.testing.contract import contract_params


@pytest.mark.parametrize("case", contract_params("example.fused_add_rmsnorm"))
def test_provider_contract(case):
    report = case.run()
    if case.check == "parity":
        assert report.stats["cases_accepted"] > 0, "the candidate accepted nothing, so parity was never compared"


def test_the_package_under_test_is_the_installed_one():
    import layer_boundary_example
    from importlib import metadata

    files = metadata.distribution("layer-boundary-example").locate_file("layer_boundary_example/__init__.py")
    assert Path(layer_boundary_example.__file__).resolve() == Path(files).resolve()
