"""Test worlds and helpers for the boundary and for plugin authors.

Opt in from a conftest: `pytest_plugins = ["layer_boundary.testing.pytest_plugin"]`. Plugin
authors check their records with the provider contract suite, `layer_boundary.testing.contract`.
"""

from .threaded import CollectiveAborted, ThreadWorld, run_threaded

__all__ = ["ThreadWorld", "run_threaded", "CollectiveAborted"]
