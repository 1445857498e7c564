"""Skips for the few core tests that need a separately installed distribution: the core-alone
matrix environment has none, the full suite has every one."""

from importlib.util import find_spec

import pytest


def needs(module: str, distribution: str):
    """Skip unless `module` (of `distribution`) is importable, saying how to install it."""
    return pytest.mark.skipif(find_spec(module) is None, reason=f"needs {distribution}: pip install {distribution}")


#: `layer-boundary run --model qwen3`: the reference model families
needs_models = needs("layer_boundary_models", "layer-boundary-models")
#: a topology with attn_cp > 1: the context-parallel plugin
needs_cp = needs("layer_boundary_cp", "layer-boundary-cp")
