"""gpu_diagnose.py's harness and probe kernels, without a GPU.

The harness must report a probe that never finishes as a hang (with the phase it was in) and a
probe that raises as an error, and go on; the probe kernels must compile for sm_90a, and the
PTX lint must pass the ones meant to work and flag the one that reproduces the H200 hang.
"""

import importlib.util
import os
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "plugins" / "cutedsl" / "gpu_diagnose.py"


@pytest.fixture(scope="module")
def diagnose():
    spec = importlib.util.spec_from_file_location("gpu_diagnose", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stuck_probe_is_a_hang_and_the_ladder_goes_on(diagnose):
    start = time.monotonic()
    res = diagnose.run_probe("selftest_stuck", 3.0, dict(os.environ))
    assert time.monotonic() - start < 20
    assert res["status"] == "hang" and "stuck on purpose" in res["detail"] and "killed after 3 s" in res["detail"]


def test_a_raising_probe_is_an_error_with_its_message(diagnose):
    res = diagnose.run_probe("selftest_raise", 30.0, dict(os.environ))
    assert res["status"] == "error" and "ValueError: raised on purpose" in res["detail"] and "_selftest_raise" in res["detail"]


def test_every_ladder_probe_has_a_function(diagnose):
    names = [n for n, _, _ in diagnose.LADDER]
    assert len(names) == len(set(names)) and all(n in diagnose.PROBE_FUNCS for n in names)
    assert diagnose.HANG_PATTERN[0] in diagnose.PROBE_FUNCS


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed")
def test_probe_kernels_compile_and_only_the_hang_reproduction_lints_dirty(tmp_path):
    from layer_boundary_cutedsl.kernels.probe_dsl import PROBES, compile_probe
    from layer_boundary_cutedsl.kernels.ptx_lint import lint

    for name, (_, threads, _, _) in PROBES.items():
        ptx = compile_probe(name, "sm_90a", keep_ptx_dir=str(tmp_path / name)).__ptx__
        problems = lint(ptx, threads)
        if name == "block_reduce_warp_idx_in_branch":
            assert len(problems) == 1 and "shfl.sync.idx" in problems[0], problems
        else:
            assert problems == [], (name, problems)
