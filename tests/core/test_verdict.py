"""The verdict of `layer-boundary run` says which error its tolerance bounds: the relative one
(max abs err over the reference's largest |logit|), in the human line and in `--json`."""

from types import SimpleNamespace

import pytest
import torch

from layer_boundary.cli.run_cmd import FP8_TOLERANCE, Reference, _verdict, verdict_line


def _check(ours, theirs, dtype="float32", fp8=None, tolerances=None):
    args = SimpleNamespace(check="hf", dtype=dtype, fp8=fp8)
    item = SimpleNamespace(record=SimpleNamespace(tolerances=tolerances or {}))
    results = [{"logits": {0: [torch.tensor(ours, dtype=torch.float64)]}}]
    return _verdict(args, item, results, Reference([[torch.tensor(theirs, dtype=torch.float64)]]))


def test_an_fp8_run_passes_on_its_relative_error_and_says_so():
    """The case that read wrong: an absolute error above the tolerance beside a PASS."""
    check = _check([4.0, 0.249], [4.0, 0.0], fp8="dynamic")
    assert check["passed"] and check["tolerance"] == FP8_TOLERANCE and check["max_abs_err"] > check["tolerance"]
    assert check["tolerance_bounds"] == "rel_err" and check["reference_max_abs"] == 4.0
    assert check["rel_err"] == pytest.approx(0.249 / 4.0)
    line = verdict_line(check)
    assert line == ("check vs hf: PASS  rel err 6.225e-02 < tolerance 1e-01 "
                    "(relative: max abs err 2.490e-01 / max |reference logit| 4.000e+00)")


def test_a_failed_check_says_the_relative_error_is_over_the_tolerance():
    check = _check([1.0, 3.0], [1.0, 2.0])
    assert not check["passed"] and check["tolerance_bounds"] == "rel_err"
    assert verdict_line(check).startswith("check vs hf: FAIL  rel err 5.000e-01 >= tolerance 1e-04 (relative: ")


def test_a_reference_of_zeros_is_bounded_absolutely_and_says_so():
    check = _check([0.0, 1e-5], [0.0, 0.0])
    assert check["passed"] and check["tolerance_bounds"] == "max_abs_err"
    assert "(absolute: the reference logits are all 0)" in verdict_line(check)


def test_non_finite_logits_fail_and_say_why():
    check = _check([float("nan"), 1.0], [1.0, 1.0])
    assert check["passed"] is False and check["reference_max_abs"] is None
    assert verdict_line(check).startswith("check vs hf: FAIL  logits not finite")
