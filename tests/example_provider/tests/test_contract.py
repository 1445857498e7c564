"""The example's own tests: the provider contract suite, as a plugin author runs it."""

import pytest

from layer_boundary.testing.contract import contract_params


@pytest.mark.parametrize("case", contract_params("example.fused_add_rmsnorm"))
def test_provider_contract(case):
    report = case.run()
    if case.check == "parity":
        assert report.stats["cases_accepted"] > 0, "the candidate accepted nothing, so parity was never compared"
