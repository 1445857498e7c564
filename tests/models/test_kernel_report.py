"""Which kernel ran: a rank's report, recorded by the selection function while the model is built
and prepared, and counted per call in eager runs. A vendor's provider registered inline shows by
name at every boundary it took, with how often its candidate accepted and declined (checked
against the candidate's own call log), a provider that declines shows with its reason, and the
local kernels (add + norm per norm, rope, decode attention, gated activation) are named. Under
torch.compile the report gives the choices captured and says nothing was counted."""

import copy

import attrs
import pytest
import torch

from layer_boundary import FusedMlpInput, Topology
from layer_boundary_models import family, model_config
from layer_boundary.cli.kernel_report import choices, summary_lines
from layer_boundary.cli.run_cmd import _kernels
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary.plugin import FusionProvider, add_rms_norm, hookimpl
from layer_boundary.testing.threaded import run_threaded

#: the vendor's candidate takes batches of at most this many rows (the decode steps here)
MAX_ROWS = 4


class Vendor:
    """Plugin 'vendor': one provider that takes every stage whose input may owe a sum (its
    candidate declines batches above MAX_ROWS rows), one that declines every stage with a reason."""

    def __init__(self):
        self.calls = []  # (stage label, rows) of every accepted call, on every rank

    def attention_input(self, stage):
        norm, label, calls = stage.norm, stage.label, self.calls

        def run(owed, residual, fwd):
            rows = owed.partial.shape[0]
            if rows > MAX_ROWS:
                return None
            calls.append((label, rows))
            return add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)

        return (FusedMlpInput(run=run, name="vendor.ar_add_rmsnorm"),)

    ffn_input = attention_input

    @hookimpl
    def layer_boundary_fusion_providers(self):
        def refuse(stage):
            raise NotImplementedError("needs an NVLink domain")

        yield FusionProvider(name="vendor.fused", factory=lambda stage: self if stage.incoming_sum is not None else None, priority=10)
        yield FusionProvider(name="vendor.nvlink", factory=refuse, priority=20)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    config = model_config("qwen3", {**dict(model_config("qwen3").hf), "num_hidden_layers": 2})
    weights = tmp_path_factory.mktemp("report") / "w.pt"
    torch.save(family("qwen3").random_weights(config, torch.float64, 0), weights)
    prompts, decode = make_requests(config.vocab_size, 3, 5, 2, 0)
    return RunJob(model="qwen3", hf_config=dict(config.hf), topology=Topology(tp=2), reduction="ar", dtype="float64",
                  weights=str(weights), prompts=prompts, decode_tokens=decode)


def test_a_vendors_provider_is_reported_by_name_with_its_counts(fresh_registry, inline_plugin, job):
    vendor = inline_plugin(Vendor(), name="vendor")
    results = run_threaded(run_rank, Topology(tp=2), job, timeout=120)
    report = _kernels(results)
    assert report["rank"] == 0 and report["ranks_differ"] == [] and report["counting"].startswith("eager")
    owed = [b for b in report["boundaries"] if b["candidates"]]
    # every input after the stack entry completes a sum: two layers, three inputs
    assert [b["label"] for b in owed] == ["layer0.1:ffn", "layer1.0:attention", "layer1.1:ffn"]
    decode_steps, rows_per_decode = len(job.decode_tokens), len(job.prompts)
    for b in owed:
        assert b["providers"]["chosen"] == [{"candidate": "vendor.fused", "plugin": "vendor"},
                                            {"candidate": "core.unfused", "plugin": "core"}]
        assert {"candidate": "vendor.nvlink", "plugin": "vendor", "reason": "needs an NVLink domain"} in b["providers"]["declined"]
        mine, core = b["candidates"]
        accepted_here = [rows for label, rows in vendor.calls if label == b["label"]]
        assert accepted_here == [rows_per_decode] * decode_steps * 2  # both ranks' calls, the decode steps only
        assert mine == {"candidate": "vendor.ar_add_rmsnorm", "plugin": "vendor", "accepted": decode_steps, "declined": 1}
        assert core == {"candidate": "core.unfused", "plugin": "core", "accepted": 1, "declined": 0}  # the prefill
        assert b["norm"][0]["op"] == "add + norm" and b["norm"][0]["kernel"] == "core.torch"
    entry = report["boundaries"][0]
    assert entry["label"] == "layer0.0:attention" and entry["candidates"] == []
    assert {"candidate": "vendor.fused", "plugin": "vendor", "reason": "returned None"} in entry["providers"]["declined"]
    fusion, local = summary_lines(report)
    assert f"vendor.ar_add_rmsnorm accepted {3 * decode_steps}, declined 3" in fusion
    assert "core.unfused accepted 3, declined 0" in fusion and "vendor.nvlink (needs an NVLink domain)" in fusion
    assert local.startswith("local kernels: add + norm core.torch (") and "gated activation core.torch" in local
    points = {s["point"]: s["chosen"] for s in report["model"]}
    assert points["model_families"] == "models.qwen3"
    assert {points[p] for p in ("rope_kernels", "decode_attention_kernels", "gated_activation_kernels")} == {"core.torch"}
    norms = {name for group in report["norms"] for name in group["norms"]}
    assert {"norm", "layers.0.input_layernorm", "layers.1.self_attn.q_norm"} <= norms


def test_ranks_that_chose_otherwise_are_named_and_counts_do_not_count(fresh_registry, job):
    results = run_threaded(run_rank, Topology(tp=2), job, timeout=120)
    assert _kernels(results)["ranks_differ"] == []
    counted = copy.deepcopy(results[1]["kernels"])
    results[1]["kernels"]["boundaries"][1]["candidates"][0]["accepted"] += 1
    assert choices(results[1]["kernels"]) == choices(counted) and _kernels(results)["ranks_differ"] == []
    results[1]["kernels"]["boundaries"][1]["providers"]["chosen"] = []
    assert _kernels(results)["ranks_differ"] == [1]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_run_reports_the_choices_captured_and_no_counts(fresh_registry, inline_plugin, job):
    inline_plugin(Vendor(), name="vendor")
    results = run_threaded(run_rank, Topology(tp=2), attrs.evolve(job, compile="eager"), timeout=300)
    assert all(r["graph_breaks"] == 0 for r in results)
    report = _kernels(results)
    assert report["counting"].startswith("off: compiled with torch.compile (backend eager)")
    owed = [b for b in report["boundaries"] if b["candidates"]]
    assert owed and all(c == {"candidate": c["candidate"], "plugin": c["plugin"]} for b in owed for c in b["candidates"])
    assert [c["candidate"] for c in owed[0]["candidates"]] == ["vendor.ar_add_rmsnorm", "core.unfused"]
    fusion, _ = summary_lines(report)
    assert fusion.startswith("fusion (not counted: off: compiled with torch.compile (backend eager))")
    assert "vendor.ar_add_rmsnorm at 3 boundaries" in fusion
