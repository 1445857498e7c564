"""The layout sweep's kernel names (no GPU, no cutlass): `--candidates` takes names as the sweep
prints them, so every printed name must parse back to the options that built it."""

import pytest
import torch

from layer_boundary_cutedsl.add_norm_sweep import candidate_layouts, candidate_name, main, parse_candidate
from layer_boundary_cutedsl.kernels.tiling import AddNormVariant


@pytest.mark.parametrize("hidden", [2048, 4096, 7168, 8192])
def test_every_candidate_name_parses_back_and_builds(hidden):
    names = candidate_layouts(hidden)
    assert len(names) == len(set(names))
    for name in names:
        options = parse_candidate(name)
        late = options.pop("late_trigger")
        assert candidate_name(late=late, **options) == name
        AddNormVariant(torch.bfloat16, hidden, late_trigger=late, **options)  # fits the width


def test_the_reread_kernels_are_candidates_where_their_rows_fit_shared_memory():
    assert {"default+s+r", "default+s+r+o8", "128x2+s+r+o4", "64x2+s+r+o4"} <= set(candidate_layouts(4096))
    # two rows of 7168 staged for 256 threads take 57 KiB: over what a CTA gets without opting in
    assert "128x2+s+r+o4" not in candidate_layouts(7168)


def test_parse_candidate_options_and_errors():
    plain = dict(layout=None, staged=False, late_trigger=False, reread=False, ctas_per_sm=0, late_gamma=False, l1_staging=False, no_loop=False)
    assert parse_candidate("64x2+s+late+r+o4") == {**plain, **dict(layout=(64, 2), staged=True, late_trigger=True, reread=True, ctas_per_sm=4)}
    assert parse_candidate("default") == plain
    flashinfer_like = dict(layout=(64, 2), staged=True, l1_staging=True, late_trigger=True, late_gamma=True)
    assert parse_candidate("64x2+s+l1+late+g") == {**plain, **flashinfer_like}
    assert candidate_name(**{k: v for k, v in flashinfer_like.items() if k != "late_trigger"}, late=True) == "64x2+s+l1+late+g"
    assert parse_candidate("default+nl") == {**plain, "no_loop": True} and candidate_name(None, no_loop=True) == "default+nl"
    with pytest.raises(ValueError, match="needs \\+s"):
        parse_candidate("default+r")
    with pytest.raises(ValueError, match="needs \\+s"):
        parse_candidate("default+l1")
    with pytest.raises(ValueError, match="unknown flag"):
        parse_candidate("default+x")
    with pytest.raises(ValueError, match="THREADSxROWS"):
        parse_candidate("wide+s")


def test_candidates_need_layouts_and_good_names(capsys):
    with pytest.raises(SystemExit):
        main(["--candidates", "default"])
    assert "add --layouts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--layouts", "--candidates", "default+r"])
    assert "needs +s" in capsys.readouterr().err


def test_bench_cutedsl_refuses_a_bad_kernel_name_before_any_gpu_work(capsys):
    from layer_boundary_cutedsl.bench import main as bench_main

    with pytest.raises(SystemExit):
        bench_main(["--kernel", "64x2+r"])
    assert "needs +s" in capsys.readouterr().err
