"""Residual shapes FlashInfer's fused patterns do not take (an output norm owed before the add:
Gemma 3's sandwich, OLMo-2's post-norm; a LayerNorm read: GPT-NeoX): the plugin contributes its
plain all-reduce there and the stage's norms run as local kernels (`Stage.read_complete`).
Threaded TP=2, float32, the reference backend standing in for the kernels."""

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present, model_logits, prompt_batches, tiny_model
from layer_boundary import Topology, boundaries_of
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.eligibility import plain_stage_reason, stage_reason
from layer_boundary_flashinfer.provider import PLAIN_NAME
from layer_boundary_flashinfer.service import prepare_flashinfer_fusion
from layer_boundary_flashinfer.workspace import WorkspaceManager

LAYERS = 3


def _run(parallel, name):
    backend = ReferenceBackend()
    manager = WorkspaceManager(backend)
    with hardware_present():
        config, model = tiny_model(name, parallel)
    plans = [b.plan for b in boundaries_of(model)]
    prompts = prompt_batches(config)
    unfused = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model, max_tokens=64, manager=manager)
    fused = model_logits(model, parallel, prompts)
    manager.shutdown()
    counts = {k: backend.count(k, parallel.rank) for k in ("all_reduce", "plain_all_reduce")}
    entries = [[c.name for c in p.paths[next(iter(p.paths))].entry.candidates] for p in plans]
    return {"report": report, "unfused": unfused, "fused": fused, "counts": counts, "entries": entries,
            "descriptions": [p.description for p in plans]}


@pytest.mark.parametrize("name", ["gemma3", "olmo2", "gpt_neox"])
def test_the_plain_all_reduce_then_the_local_norms(name):
    results = run_threaded(_run, Topology(tp=2), name, timeout=120)
    for res in results:
        report = res["report"]
        # every input but the stack entry: the attention's sum at the FFN input, the FFN's deferred
        # sum at the next attention input; the last FFN all-reduces in its exit (final norm)
        assert report.available and len(report.bound) == 2 * LAYERS - 1
        # the same operations as the unfused completion: the sum, then the stage's local completion
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
        # two forwards (prefill, decode); none of FlashInfer's fused add + RMSNorm
        assert res["counts"] == {"all_reduce": 0, "plain_all_reduce": 2 * (2 * LAYERS - 1)}
        assert res["entries"][0] == [] and all(e == [PLAIN_NAME, "core.unfused"] for e in res["entries"][1:])
        for desc in res["descriptions"][1:]:
            assert stage_reason(desc) is not None and plain_stage_reason(desc) is None
    assert all(torch.equal(a, b) for a, b in zip(results[0]["fused"], results[1]["fused"]))


def test_the_fused_pattern_keeps_plain_pre_norm_rms_stages():
    """Where FlashInfer's all-reduce + add + RMSNorm applies, the plain candidate is not offered."""
    (res,) = [r for r in run_threaded(_run, Topology(tp=2), "qwen3", timeout=120)][:1]
    assert all(e == ["flashinfer.ar_add_rmsnorm", "core.unfused"] for e in res["entries"][1:])
    assert res["counts"]["plain_all_reduce"] == 0 and res["counts"]["all_reduce"] > 0
