"""`layer-boundary bench cutedsl`'s command line and pure logic (no GPU, no cutlass): kernel
names (`--kernel`, `--band-kernels`, a band table's) parse to the options that build them, bad
arguments are refused before any GPU work, and `--bands-out` turns timings into a
`tiling.ROWS_BANDS` table."""

import json
import re

import pytest
import torch

from layer_boundary_cutedsl import bench
from layer_boundary_cutedsl.kernels import tiling
from layer_boundary_cutedsl.kernels.tiling import AddNormVariant, parse_candidate


@pytest.mark.parametrize("hidden", bench.BAND_WIDTHS)
def test_every_band_kernel_name_parses_and_builds(hidden):
    names = set(bench.BAND_KERNELS) | {name for bands in tiling.SHIPPED_ROWS_BANDS.values() for _, _, name in bands}
    for name in sorted(names):
        AddNormVariant(torch.bfloat16, hidden, **parse_candidate(name))  # fits the width


def test_parse_candidate_options_and_errors():
    plain = dict(layout=None, staged=False, late_trigger=False, reread=False, ctas_per_sm=0, late_gamma=False, l1_staging=False, no_loop=False)
    assert parse_candidate("64x2+s+late+r+o4") == {**plain, **dict(layout=(64, 2), staged=True, late_trigger=True, reread=True, ctas_per_sm=4)}
    assert parse_candidate("default") == plain
    flashinfer_like = dict(layout=(64, 2), staged=True, l1_staging=True, late_trigger=True, late_gamma=True)
    assert parse_candidate("64x2+s+l1+late+g") == {**plain, **flashinfer_like}
    assert parse_candidate("default+nl") == {**plain, "no_loop": True}
    assert parse_candidate("auto") == dict(layout="auto")
    with pytest.raises(ValueError, match="needs \\+s"):
        parse_candidate("default+r")
    with pytest.raises(ValueError, match="needs \\+s"):
        parse_candidate("default+l1")
    with pytest.raises(ValueError, match="unknown flag"):
        parse_candidate("default+x")
    with pytest.raises(ValueError, match="THREADSxROWS"):
        parse_candidate("wide+s")


def test_bench_cutedsl_refuses_a_bad_kernel_name_before_any_gpu_work(capsys):
    from layer_boundary_cutedsl.bench import main as bench_main

    with pytest.raises(SystemExit):
        bench_main(["--kernel", "64x2+r"])
    assert "needs +s" in capsys.readouterr().err


def test_side_by_side_rounds_rotate_the_order_and_ratios_pair_rounds(monkeypatch):
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
    suggest_bands = bench.suggest_bands

    def row(t, default, a, b):
        return dict(hidden=4096, tokens=t, us={"default": default, "a+late": a, "b+late": b, "fast": 0.1})

    rows = [row(128, 1.0, 1.2, 1.3), row(512, 1.0, 0.9, 0.95), row(1024, 1.0, 0.8, 0.9), row(2048, 1.0, 1.0, 0.995),
            row(4096, 1.0, 1.1, 0.9)]
    # "fast" is not a band kernel; 2048's 0.5% win is inside the margin: the default there
    assert suggest_bands(rows, ["a+late", "b+late"]) == {4096: [[320, 1536, "a+late"], [3072, 8192, "b+late"]]}
    assert suggest_bands(rows, ["missing"]) == {}


def test_a_band_file_replaces_the_shipped_table_and_bad_ones_are_refused(tmp_path, monkeypatch):
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


def test_the_shipped_bands_are_a_band_grid_output():
    """Every shipped band names a `BAND_KERNELS` kernel and has its edges where `suggest_bands`
    puts them for `BAND_TOKENS`: halfway between neighbouring counts, 1, or twice the last."""
    counts = bench.BAND_TOKENS
    edges = {1, 2 * counts[-1]} | {(a + b + 1) // 2 for a, b in zip(counts, counts[1:])}
    assert set(tiling.SHIPPED_ROWS_BANDS) == set(bench.BAND_WIDTHS)
    for hidden, bands in tiling.SHIPPED_ROWS_BANDS.items():
        for first, end, name in bands:
            assert name in bench.BAND_KERNELS and first in edges and end in edges, (hidden, first, end, name)


@pytest.mark.parametrize("argv, message", [
    (["--band-kernels", "default+late+nl"], "add --bands-out"),
    (["--band-widths", "4096", "--band-tokens", "8"], "add --bands-out"),
    (["--bands-out", "b.json", "--shapes", "1x2048"], "not --shapes"),
    (["--bands-out", "b.json", "--band-kernels", "auto"], "names a kernel"),
    (["--bands-out", "b.json", "--band-kernels", "default+r"], "needs \\+s"),
    (["--bands-out", "b.json", "--band-widths", "4095"], "hidden size"),
])
def test_band_options_are_checked_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert re.search(message, capsys.readouterr().err)


def test_bands_out_times_the_grid_and_writes_the_table(tmp_path, monkeypatch, capsys):
    """`--bands-out`: every (T, H) of the grid timed once, a line each, the suggested table in
    the file (the ROWS_BANDS form a band file takes) and the timings in --out."""
    timed = []

    def fake_time_kernels(tokens, hidden, names, iters, repeats, rounds):
        timed.append((tokens, hidden, tuple(names), rounds))
        return {"default": 1.0, "default+late+nl": 0.9 if tokens >= 100 else 1.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(bench, "time_kernels", fake_time_kernels)
    bands, out = tmp_path / "bands.json", tmp_path / "out.json"
    argv = ["--bands-out", str(bands), "--out", str(out), "--band-kernels", "default+late+nl", "--band-widths", "4096",
            "--band-tokens", "16", "128", "256", "--rounds", "3"]
    assert bench.main(argv) == 0
    assert timed == [(t, 4096, ("default+late+nl",), 3) for t in (16, 128, 256)]
    assert json.loads(bands.read_text()) == {"4096": [[72, 512, "default+late+nl"]]}
    assert tiling.load_bands(str(bands)) == {4096: ((72, 512, "default+late+nl"),)}
    assert [r["tokens"] for r in json.loads(out.read_text())["rows"]] == [16, 128, 256]
    assert capsys.readouterr().out.count("H=4096: default") == 3
