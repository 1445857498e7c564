"""The command line's one error type for bad input."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input: printed as one line (a line per problem), exit status 2, before any rank starts."""
