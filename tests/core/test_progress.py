"""The progress bar: drawn only on a terminal and never for machine output; tqdm or the plain bar."""

import io

import pytest

from layer_boundary.cli.progress import Progress, progress, wanted


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_only_on_a_terminal_and_never_with_machine_output():
    assert wanted(Terminal()) and not wanted(io.StringIO())
    assert not wanted(Terminal(), machine_output=True)
    closed = io.StringIO()
    closed.close()
    assert not wanted(closed)


def test_off_draws_nothing():
    stream = Terminal()
    with progress(5, "run", enabled=False, stream=stream) as bar:
        assert type(bar) is Progress
        bar.update(1, step="prefill")
    assert stream.getvalue() == ""


def test_the_plain_bar_redraws_one_line_in_place():
    stream = Terminal()
    with progress(4, "  run", stream=stream, plain=True) as bar:
        for step in ("prefill", "decode1", "decode2", "decode3"):
            bar.update(1, step=step)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1 and "\r" in text
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("  run 4/4 [########################]") and "step/s" in last and "decode3" in last


def test_tqdm_draws_when_installed():
    pytest.importorskip("tqdm")
    stream = Terminal()
    with progress(3, "  run", stream=stream) as bar:
        bar.update(3, step="decode2")
    assert "3/3" in stream.getvalue() and "decode2" in stream.getvalue()
