"""Soak: 10,000 forwards through the boundaries (threaded world, TP=2) without growth in live
residual streams, contributions, owed handles or tensors."""

import gc

import torch

from layer_boundary import Contribution, OwedOutput, ResidualStream, Topology, UnreducedOutput
from layer_boundary import DpPadding, Forward, ForwardMode
from layer_boundary.testing.grid import GridModel, GridSpec, grid_inputs
from layer_boundary.testing.threaded import run_threaded

FORWARDS = 10_000
SPEC = GridSpec(stages=("attn", "ffn", "mixer", "moe"), hidden=8, attn_width=8, ffn_width=8, expert_width=8)
TRACKED = (ResidualStream, Contribution, OwedOutput, UnreducedOutput, Forward, torch.Tensor)


def _live() -> dict:
    gc.collect()
    counts = {t.__name__: 0 for t in TRACKED}
    for obj in gc.get_objects():
        for t in TRACKED:
            if isinstance(obj, t):
                counts[t.__name__] += 1
    return counts


def _soak(parallel, samples):
    model = GridModel(SPEC, parallel, policy="rs+rsv")
    x = grid_inputs(SPEC, (3,))[0]
    with torch.inference_mode():
        for i in range(FORWARDS):
            mode = ForwardMode.DECODE if i % 2 else ForwardMode.EXTEND
            fwd = Forward(parallel, 3, dp_padding=DpPadding.SUM_LEN, mode=mode)
            out = model.run(x, fwd)
            assert fwd.residual_stream is None  # the final norm released the stream
            if parallel.rank == 0 and i % 2500 == 0:
                samples.append(_live())
    return out


def test_ten_thousand_forwards_leave_nothing_behind():
    samples = []
    outs = run_threaded(lambda p: _soak(p, samples), Topology(tp=2), timeout=600)
    assert torch.equal(outs[0], outs[1])
    first, last = samples[1], samples[-1]  # after warm-up
    for name in ("ResidualStream", "Contribution", "OwedOutput", "UnreducedOutput", "Forward"):
        assert last[name] <= first[name] + 2, (name, samples)
    assert last["Tensor"] <= first["Tensor"] + 16, samples
