"""FlashInfer enablement as the walkthrough says: the engine's settings object (backend
auto / trtllm / off, the token limit, auto's rules, an architecture list the engine extends), the
environment switch as an enforce-disable read at prepare, and no workspace rebuild under a
captured CUDA graph."""

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present, tiny_model
from layer_boundary import Topology
from layer_boundary.testing import requires_plugins
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer import FlashInferSettings, WorkspaceCapturedError
from layer_boundary_flashinfer.ordering import LaunchOrder
from layer_boundary_flashinfer.service import prepare_flashinfer_fusion
from layer_boundary_flashinfer.workspace import WorkspaceManager, WorkspaceSpec

QWEN3 = "Qwen3ForCausalLM"
HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


@pytest.mark.parametrize("settings, topology, capability, expected", [
    (FlashInferSettings(architecture=QWEN3), Topology(tp=2), HOPPER, None),
    (FlashInferSettings(architecture=QWEN3), Topology(tp=2), BLACKWELL, None),
    (FlashInferSettings(architecture=QWEN3), Topology(tp=2), AMPERE, "neither Hopper nor Blackwell"),
    (FlashInferSettings(architecture=QWEN3), Topology(tp=1), HOPPER, "TP is 1"),
    (FlashInferSettings(architecture=QWEN3), Topology(tp=4, attn_dp=2), HOPPER, "attention DP"),
    (FlashInferSettings(architecture=QWEN3, nodes=2), Topology(tp=2), HOPPER, "2 nodes on Hopper"),
    (FlashInferSettings(architecture=QWEN3, nodes=2), Topology(tp=2), BLACKWELL, None),  # multi-node refused on Hopper only
    (FlashInferSettings(architecture=QWEN3, moe_a2a_backend="deepep"), Topology(tp=4, moe_ep=4), HOPPER, "all-to-all backend 'deepep'"),
    (FlashInferSettings(architecture="Qwen3MoeForCausalLM"), Topology(tp=4, moe_ep=4), HOPPER, None),  # plain EP is no all-to-all
    (FlashInferSettings(architecture="MyModelForCausalLM"), Topology(tp=2), HOPPER, "not in the architectures"),
    (FlashInferSettings(architecture="MyModelForCausalLM").with_architectures("MyModelForCausalLM"), Topology(tp=2), HOPPER, None),
    (FlashInferSettings(), Topology(tp=2), HOPPER, "named no architecture"),
    (FlashInferSettings(backend="trtllm"), Topology(tp=2), AMPERE, None),  # asked for: the kernels' own rules decide
    (FlashInferSettings(backend="off", architecture=QWEN3), Topology(tp=2), HOPPER, "backend is off"),
])
def test_auto_applies_the_walkthrough_s_rules(settings, topology, capability, expected):
    reason = settings.job_reason(topology) or settings.device_reason(capability)
    if expected is None:
        assert reason is None
    else:
        assert expected in reason


def test_settings_are_checked_when_made():
    with pytest.raises(ValueError, match="flashinfer backend 'on': choose one of auto, trtllm, off"):
        FlashInferSettings(backend="on")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        FlashInferSettings(max_tokens=0)


def _prepare(settings, *, capability=HOPPER, max_tokens=None):
    def fn(parallel):
        manager = WorkspaceManager(ReferenceBackend(capability=capability))
        with hardware_present():
            _, model = tiny_model("qwen3", parallel)
        report = prepare_flashinfer_fusion(model, manager=manager, settings=settings, max_tokens=max_tokens)
        manager.shutdown()
        return report

    return run_threaded(fn, Topology(tp=2), timeout=60)


def test_prepare_follows_the_engine_s_settings():
    on = _prepare(FlashInferSettings(architecture=QWEN3, max_tokens=32))
    assert all(r.available and r.bound and r.max_tokens == 32 for r in on)
    for settings, capability, why in [
        (FlashInferSettings(architecture="MyModelForCausalLM"), HOPPER, "not in the architectures"),
        (FlashInferSettings(architecture=QWEN3), AMPERE, "neither Hopper nor Blackwell"),
        (FlashInferSettings(backend="off"), HOPPER, "backend is off"),
    ]:
        for report in _prepare(settings, capability=capability):
            assert not report.available and not report.bound
            assert all(why in reason for _, reason in report.skipped if reason.startswith("no workspace"))
    extended = _prepare(FlashInferSettings(architecture="MyModelForCausalLM").with_architectures("MyModelForCausalLM"))
    assert all(r.available for r in extended)


def test_the_environment_switch_set_after_the_model_was_built_still_turns_the_fusion_off(monkeypatch):
    def fn(parallel):
        manager = WorkspaceManager(ReferenceBackend())
        with hardware_present():
            _, model = tiny_model("qwen3", parallel)
        barrier.wait()
        if parallel.rank == 0:
            monkeypatch.setenv("LAYER_BOUNDARY_FLASHINFER", "0")
        barrier.wait()
        report = prepare_flashinfer_fusion(model, manager=manager, max_tokens=16)
        manager.shutdown()
        return report

    import threading

    barrier = threading.Barrier(2)
    for report in run_threaded(fn, Topology(tp=2), timeout=60):
        assert not report.available and not report.bound
        assert any("LAYER_BOUNDARY_FLASHINFER=0 (enforce-disable)" in reason for _, reason in report.skipped)


# --- no rebuild under a captured graph ------------------------------------------------------------


def test_a_launch_inside_a_capture_marks_the_workspace_captured(monkeypatch):
    order = LaunchOrder()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "stream")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    order()
    assert not order.captured
    capturing[0] = True
    order()
    assert order.captured
    order.reset()
    assert not order.captured


def test_a_rebuild_after_a_graph_was_captured_on_the_workspace_is_refused():
    small, big = WorkspaceSpec(16, 32, torch.float32), WorkspaceSpec(64, 32, torch.float32)

    def fn(parallel):
        backend = ReferenceBackend()
        manager = WorkspaceManager(backend)
        slot = manager.slot(parallel.groups["tp"], torch.float32, "cpu")
        assert slot.ensure(small, None).action == "created"
        slot.order.captured = True  # a fused launch was recorded into a CUDA graph
        assert slot.ensure(small, None).action == "reused"  # reusing keeps the graph's addresses: fine
        with pytest.raises(WorkspaceCapturedError, match=r"cannot be rebuilt .* a CUDA graph was captured on it"):
            slot.ensure(big, None)
        kept = slot.available and slot.spec == small  # nothing released
        with pytest.raises(WorkspaceCapturedError, match=r"cannot be given up"):
            slot.ensure(small, "the device went away")
        again = slot.ensure(big, None, recapture=True).action  # the engine drops its graphs
        slot.order.captured = True
        manager.graphs_dropped()  # or says so once they are gone
        dropped = slot.ensure(WorkspaceSpec(128, 32, torch.float32), None).action
        manager.shutdown()
        return kept, again, dropped

    assert run_threaded(fn, Topology(tp=2), timeout=30) == [(True, "rebuilt", "rebuilt")] * 2


# --- LoRA under FlashInfer ------------------------------------------------------------------------


@requires_plugins("lora")
def test_a_lora_ffn_leaves_its_sum_to_the_next_input_s_fusion_once_prepared():
    """A LoRA FFN's sum waits only for a fused consumer (`fused_consumer_only`): the flashinfer
    provider accepts it (`can_defer_all_reduce`) for the batches the next input's fused kernel
    takes, once the workspace is agreed; before prepare and after shutdown the FFN completes it."""
    from layer_boundary import Forward, boundaries_of, get_forward, residual_batch
    from layer_boundary_models import build_model, family, model_config
    from layer_boundary_models.lora_layers import random_lora_spec

    from flashinfer_fakes import CONFIGS

    def decisions(ffns, parallel):
        out = []
        for boundary in ffns:
            row = []
            for n in (0, 1, 16, 17):
                fwd = Forward(parallel, n)
                residual_batch.start(fwd)
                with boundary.exit(fwd):
                    row.append(get_forward().fuse_mlp_allreduce)
            out.append(row)
        return out

    def fn(parallel):
        config = model_config("qwen3", dict(family("qwen3").preset(), **CONFIGS["qwen3"]))
        with hardware_present():
            model = build_model(config, parallel, dtype=torch.float32, lora=random_lora_spec(2))
        ffns = [b for b in boundaries_of(model) if b.plan.kind.value == "ffn" and not b.plan.terminal]
        assert ffns and all(b.plan.fused_consumer_only for b in ffns)
        manager = WorkspaceManager(ReferenceBackend())
        before = decisions(ffns, parallel)
        prepare_flashinfer_fusion(model, manager=manager, max_tokens=16)
        during = decisions(ffns, parallel)
        manager.shutdown()
        return before, during, decisions(ffns, parallel)

    for before, during, after in run_threaded(fn, Topology(tp=2), timeout=60):
        assert all(row == [False] * 4 for row in before + after)
        assert all(row == [False, True, True, False] for row in during)


def test_prepare_model_passes_the_engine_s_flashinfer_settings(monkeypatch):
    """`layer_boundary.prepare_model(model, settings={"flashinfer": ...})` reaches the plugin's prepare."""
    from layer_boundary import prepare_model
    from layer_boundary_flashinfer import service

    seen = []
    monkeypatch.setattr(service, "prepare_flashinfer_fusion", lambda model, **kw: seen.append(kw))
    settings = FlashInferSettings(backend="off", max_tokens=64)
    prepare_model(torch.nn.Module(), max_tokens=512, settings={"flashinfer": settings})
    prepare_model(torch.nn.Module(), max_tokens=512)
    assert seen == [{"max_tokens": None, "settings": settings}, {"max_tokens": 512, "settings": None}]


def test_the_settings_fingerprint_is_the_same_in_every_process():
    """Ranks compare a fingerprint of the settings; a set's order follows string hashes, which
    differ between processes, so the fingerprint lists the architectures sorted."""
    settings = FlashInferSettings(architecture=QWEN3, architectures=("Zeta", "Alpha", "Mu"))
    assert settings.fingerprint() == repr(("auto", None, QWEN3, ("Alpha", "Mu", "Zeta"), 1, None))
    assert settings.fingerprint() == FlashInferSettings(architecture=QWEN3, architectures=("Mu", "Zeta", "Alpha")).fingerprint()
