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


def test_side_by_side_rounds_rotate_the_order_and_ratios_pair_rounds(monkeypatch):
    from layer_boundary_cutedsl import bench

    order = []
    clock = iter(range(1, 100))

    def fake_time_graph(fn, iters, repeats):
        order.append(fn())
        return float(next(clock))

    monkeypatch.setattr(bench, "time_graph", fake_time_graph)
    times = bench.time_side_by_side(dict(ours=lambda: "ours", flashinfer=lambda: "fi"), 20, 50, 3)
    assert order == ["ours", "fi", "fi", "ours", "ours", "fi"]  # each round starts one later
    assert times == dict(ours=[1.0, 4.0, 5.0], flashinfer=[2.0, 3.0, 6.0])
    assert bench.ratio_spread(times["ours"], times["flashinfer"]) == [0.5, 4 / 3]


def test_bench_shapes_parse_and_bad_ones_are_refused_before_any_gpu_work(capsys):
    from layer_boundary_cutedsl.bench import main as bench_main, shape

    assert shape("1024x4096") == (1024, 4096) and shape("1X2048") == (1, 2048)
    for bad in ("1024", "x4096", "0x4096", "1024x-8", "axb"):
        with pytest.raises(SystemExit):
            bench_main(["--shapes", bad])
        assert "TOKENSxHIDDEN" in capsys.readouterr().err
    for bad_width in ("1024x4095", "1024x0", "8x32768"):  # not whole 16-byte vectors, or wider than the kernels take
        with pytest.raises(SystemExit):
            bench_main(["--shapes", bad_width])
        assert "hidden size" in capsys.readouterr().err


def test_buffer_sets_are_distinct_live_pairs_of_the_case_shape():
    from layer_boundary_cutedsl.bench import DT, buffer_sets

    pairs = buffer_sets(8, 64, 3, device="cpu")
    assert len(pairs) == 3
    pointers = {t.data_ptr() for pair in pairs for t in pair}
    assert len(pointers) == 6  # no pair shares storage with another: each is timed on its own buffers
    assert all(t.shape == (8, 64) and t.dtype == DT for pair in pairs for t in pair)
    assert not torch.equal(pairs[0][0], pairs[1][0])  # random rows, not one pattern copied


def test_bench_table_shows_the_side_by_side_ratio_and_its_spread():
    from layer_boundary_cutedsl.bench import table

    row = dict(kernel="add_rmsnorm", tokens=1024, hidden=4096, cutedsl_us=6.0, cutedsl_gbs=5600.0, frac_of_copy=1.3, fits_l2=True,
               torch_unfused_us=99.0, cutedsl_inplace_us=6.4, flashinfer_us=5.9, cutedsl_beside_flashinfer_us=5.8,
               ours_over_flashinfer=5.8 / 5.9, ours_over_flashinfer_spread=[0.97, 1.01])
    line = [x for x in table([row]).splitlines() if x.startswith("add_rmsnorm")][0]
    assert line.split()[-4:] == ["5.90", "5.80", "0.98", "0.97-1.01"]
    bare = dict(row, kernel="moe_finalize_add_rmsnorm", top_k=8)
    for key in [k for k in row if "flashinfer" in k or "inplace" in k]:
        bare.pop(key)
    assert table([bare]).splitlines()[-2].split()[-4:] == ["-", "-", "-", "-"]


def test_suggested_bands_merge_each_kernels_winning_counts():
    from layer_boundary_cutedsl.add_norm_sweep import suggest_bands

    def row(t, default, a, b):
        return dict(hidden=4096, tokens=t, us={"default": default, "a+late": a, "b+late": b, "fast": 0.1})

    rows = [row(128, 1.0, 1.2, 1.3), row(512, 1.0, 0.9, 0.95), row(1024, 1.0, 0.8, 0.9), row(2048, 1.0, 1.0, 0.995),
            row(4096, 1.0, 1.1, 0.9)]
    # "fast" is not a band kernel; 2048's 0.5% win is inside the margin: the default there
    assert suggest_bands(rows, ["a+late", "b+late"]) == {4096: [[320, 1536, "a+late"], [3072, 8192, "b+late"]]}
    assert suggest_bands(rows, ["missing"]) == {}


def test_a_band_file_replaces_the_shipped_table_and_bad_ones_are_refused(tmp_path, monkeypatch):
    import json

    from layer_boundary_cutedsl.kernels import tiling

    good = tmp_path / "bands.json"
    good.write_text(json.dumps({"4096": [[384, 1024, "default+late+nl"], [1024, 2048, "128x1+s+l1+late+g+nl"]]}))
    monkeypatch.setenv(tiling.ROWS_BANDS_ENV, str(good))
    assert tiling._rows_bands() == {4096: ((384, 1024, "default+late+nl"), (1024, 2048, "128x1+s+l1+late+g+nl"))}
    for bad, message in [({"4096": [[1024, 384, "default"]]}, "increasing order"), ({"4096": [[1, 9, "default+r"]]}, "needs \\+s"),
                         ({"4096": [[1, 9, "auto"]]}, "names a kernel"), ({"4096": [[1, 9, "x"], [5, 20, "default"]]}, "THREADSxROWS")]:
        good.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            tiling._rows_bands()
    monkeypatch.delenv(tiling.ROWS_BANDS_ENV)
    assert tiling._rows_bands() == tiling.check_bands(tiling.SHIPPED_ROWS_BANDS)
