"""Argument types and the parser of the command line: a number out of range is refused by the
parser itself, as one line naming the option and the fix (exit status 2), before any work starts.

The benchmarks (`layer-boundary bench NAME -- ...`, core and plugins) parse their own options
with the same parser class and types, so every numeric option of every command obeys one rule.
"""

from __future__ import annotations

import argparse
from typing import Callable, NoReturn

__all__ = ["OneLineParser", "positive_int", "non_negative_int", "positive_float", "at_least"]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit status 2.

    Subparsers made from it are of the same class (argparse copies the parser class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def at_least(low, kind: Callable = int, what: str = "an integer") -> Callable[[str], object]:
    """An argparse `type`: `kind(text)`, refused below `low` with a message naming the fix."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value != value or value < low:  # NaN never compares below
            bound = "positive" if low == 1 and kind is int else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}; pass {low} or more")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


positive_int = at_least(1)
non_negative_int = at_least(0)
positive_float = _positive_float
