"""Test worlds and helpers for the boundary and for plugin authors.

Opt in from a conftest: `pytest_plugins = ["layer_boundary.testing.pytest_plugin"]`.
"""

from .threaded import CollectiveAborted, ThreadWorld, run_threaded

__all__ = ["ThreadWorld", "run_threaded", "CollectiveAborted"]
