"""Debug mode's check of declining fusion candidates also works in model runs, whose tensors are
made under torch.inference_mode() and so carry no version counter: there it compares values
(a write that leaves every value as it was is then invisible)."""

import pytest
import torch

from layer_boundary import FusedMlpInput, FusionError, Topology
from layer_boundary import _fusions as fusions_module
from layer_boundary.testing.threaded import run_threaded

from test_fusion_chain import _layer_run


def _debug_on(monkeypatch):
    """Switch debug mode on wherever this version of the core reads the flag."""
    for module in (fusions_module, getattr(fusions_module, "debug", None)):
        if module is not None and hasattr(module, "DEBUG"):
            monkeypatch.setattr(module, "DEBUG", True)


class Declines:
    def __init__(self, touch):
        self.touch = touch

    def ffn_input(self, plan):
        def run(owed, residual, fwd):
            if self.touch:
                owed.partial.mul_(2.0)  # an in-place write, then a decline
            return None

        return (FusedMlpInput(run=run, name="test.declines"),)

    attention_input = ffn_input


def _step(parallel, provider):
    with torch.inference_mode():  # as model runs are
        return _layer_run(parallel, fusions=provider)


def test_a_clean_decline_passes_under_inference_mode(monkeypatch):
    _debug_on(monkeypatch)
    plain = run_threaded(lambda p: _step(p, None), Topology(tp=2))
    declined = run_threaded(lambda p: _step(p, Declines(touch=False)), Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(plain, declined))


def test_a_decline_after_a_write_is_caught_under_inference_mode(monkeypatch):
    _debug_on(monkeypatch)
    with pytest.raises(FusionError, match="declined after modifying its inputs"):
        run_threaded(lambda p: _step(p, Declines(touch=True)), Topology(tp=2))
