"""A progress bar for long work (`layer-boundary run`'s steps, the GPU soak): tqdm when it is
installed (`pip install 'layer-boundary[progress]'`; transformers brings it too), else a plain
bar of our own; nothing at all when the stream is not a terminal (logs, pipes, CI) or when the
caller asks for machine output (`--json`).

The core keeps its three dependencies (torch, pluggy, attrs): tqdm is optional, and the plain
bar draws the same line (count, bar, rate) with carriage returns.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "progress", "wanted"]


def wanted(stream: Optional[TextIO] = None, *, machine_output: bool = False) -> bool:
    """Whether a bar belongs on `stream` (default stderr): a terminal, and no --json."""
    stream = sys.stderr if stream is None else stream
    if machine_output:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def _columns(stream: TextIO) -> int:
    """The terminal's width; 80 where it reports none (a fresh pseudo-terminal says 0)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return 80


class Progress:
    """The bar's interface: `update(n, step=...)` and `close()`; a no-op when off."""

    def update(self, n: int = 1, step: Optional[str] = None) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Tqdm(Progress):
    def __init__(self, total: int, desc: str, stream: TextIO, unit: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, file=stream, unit=unit, leave=True, ncols=_columns(stream))

    def update(self, n: int = 1, step: Optional[str] = None) -> None:
        if step is not None:
            self.bar.set_postfix_str(step, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class _Plain(Progress):
    """`desc  12/100 [######--------------]  3.4 step/s  decode12`, redrawn in place."""

    WIDTH = 24
    #: at most this many redraws a second (a fast loop must not spend its time drawing)
    RATE = 10.0

    def __init__(self, total: int, desc: str, stream: TextIO, unit: str):
        self.total, self.desc, self.stream, self.unit = max(total, 0), desc, stream, unit
        self.done = 0
        self.step = ""
        self.columns = _columns(stream)
        self.start = self.last = time.monotonic()
        self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // self.total if self.total else self.WIDTH
        elapsed = time.monotonic() - self.start
        rate = f"{self.done / elapsed:.1f} {self.unit}/s" if elapsed > 0 and self.done else f"- {self.unit}/s"
        line = f"{self.desc} {self.done:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'-' * (self.WIDTH - filled)}] {rate} {self.step}"
        self.stream.write("\r" + line.rstrip()[: self.columns - 1] + "\x1b[K")  # one row, or \r cannot redraw it
        self.stream.flush()

    def update(self, n: int = 1, step: Optional[str] = None) -> None:
        self.done += n
        if step is not None:
            self.step = step
        now = time.monotonic()
        if now - self.last >= 1.0 / self.RATE or self.done >= self.total:
            self.last = now
            self._draw()

    def close(self) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()


def progress(total: int, desc: str, *, enabled: bool = True, stream: Optional[TextIO] = None, unit: str = "step", plain: bool = False) -> Progress:
    """A bar over `total` units on `stream` (default stderr), or a no-op one when `enabled` is
    false. `plain=True` draws our own bar even where tqdm is installed."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return Progress()
    if not plain:
        try:
            return _Tqdm(total, desc, stream, unit)
        except ImportError:
            pass
    return _Plain(total, desc, stream, unit)
