"""Where the fusion applies: stage rules from the frozen description (identical on every rank),
device rules, settings, and the one-shot choice per token count."""

import pytest
import torch

from flashinfer_fakes import hardware_present
from layer_boundary import Topology
from layer_boundary import StageKind
from layer_boundary import SumGroup
from layer_boundary.testing.contract import ContractSettings
from layer_boundary.testing._contract.stages import stage_descriptions
from layer_boundary_flashinfer import eligibility
from layer_boundary_flashinfer.backend import MAX_COMM_SIZE, oneshot_table, workspace_bytes
from layer_boundary_flashinfer.eligibility import device_reason, finalize_stage_reason, plain_stage_reason, settings, stage_reason
from layer_boundary_flashinfer.plugin import build_provider
from layer_boundary_flashinfer.provider import FlashInferFinalizeFusion, FlashInferFusion
from layer_boundary_flashinfer.workspace import WorkspaceSpec

SETTINGS = ContractSettings(described_topologies=(Topology(tp=2, attn_dp=2), Topology(tp=4, moe_ep=2), Topology(tp=4)))


def _descriptions():
    return {(d.label.split(".")[0], d.topology, d.norm_kind): d for d in stage_descriptions(SETTINGS)}


def _find(label, topology, norm="rms"):
    return _descriptions()[(label, topology, norm)]


@pytest.fixture
def gpu_rank():
    with hardware_present():
        yield


def test_stage_rules(gpu_rank):
    tp2 = Topology(tp=2)
    for label in ("ffn_after_attention", "attention_after_ffn", "attention_after_moe", "moe_after_attention"):
        for norm in ("rms", "gemma_rms"):
            assert stage_reason(_find(label, tp2, norm)) is None, (label, norm)
            assert stage_reason(_find(label, Topology(tp=4), norm)) is None
    assert "nothing is ever owed" in stage_reason(_find("attention_at_entry", tp2))
    assert "not a plain add" in stage_reason(_find("attention_after_scaled_ffn", tp2))
    assert "not an RMSNorm" in stage_reason(_find("ffn_after_attention", tp2, "other"))
    assert "1 rank" in stage_reason(_find("attention_after_ffn", Topology(tp=1)))
    assert "attention DP" in stage_reason(_find("attention_after_ffn", Topology(tp=2, attn_dp=2)))
    # plain expert parallelism over the TP group sums with one all-reduce: no reason (an all-to-all backend is, FlashInferSettings)
    assert stage_reason(_find("attention_after_ffn", Topology(tp=4, moe_ep=2))) is None


def test_where_the_fused_patterns_stop_the_plain_all_reduce_starts(gpu_rank):
    """An output norm owed before the add (sandwich, post-norm) or a LayerNorm or identity read:
    no fused pattern takes it, FlashInfer's plain all-reduce does (the norms then run locally)."""
    tp2 = Topology(tp=2)
    for label in ("ffn_after_post_norm_attention", "attention_after_post_norm_ffn"):
        for norm in ("rms", "gemma_rms", "layer", "none"):
            d = _find(label, tp2, norm)
            assert "output norm before the add" in stage_reason(d) and plain_stage_reason(d) is None, (label, norm)
        assert "norm kind 'other'" in plain_stage_reason(_find(label, tp2, "other"))
        under_dp = _find(label, Topology(tp=2, attn_dp=2), "layer")  # rows move: the exit completes the post-norm itself
        assert under_dp.post_norm_kind is None and plain_stage_reason(under_dp) is not None
    for norm in ("layer", "none"):
        d = _find("ffn_after_attention", tp2, norm)
        assert "not an RMSNorm" in stage_reason(d) and plain_stage_reason(d) is None
    assert "takes this input" in plain_stage_reason(_find("ffn_after_attention", tp2, "rms"))
    assert "not a plain add" in plain_stage_reason(_find("attention_after_scaled_ffn", tp2, "layer"))


def test_the_factory_follows_the_rules_and_picks_the_finalize_provider_for_moe(gpu_rank):
    descriptions = stage_descriptions(SETTINGS)
    for d in descriptions:
        provider = build_provider(d)
        eligible = stage_reason(d) is None or plain_stage_reason(d) is None or finalize_stage_reason(d) is None
        assert (provider is not None) == eligible, d.label
        if provider is not None:
            assert provider.offers_input == (stage_reason(d) is None)
            assert provider.offers_plain == (plain_stage_reason(d) is None)
            assert isinstance(provider, FlashInferFinalizeFusion) == (finalize_stage_reason(d) is None)
            assert provider.takes_handoff == (provider.offers_input and d.incoming_sum is SumGroup.MOE_OUTPUT)
    moe = build_provider(_find("moe_after_attention", Topology(tp=2)))
    assert isinstance(moe, FlashInferFinalizeFusion) and moe.description.kind is StageKind.FFN and moe.description.sparse
    assert isinstance(build_provider(_find("attention_after_moe", Topology(tp=2))), FlashInferFusion)


def test_switches_turn_the_plugin_or_the_finalize_handoff_off(gpu_rank, monkeypatch):
    moe = _find("moe_after_attention", Topology(tp=2))
    monkeypatch.setenv(eligibility.FINALIZE_ENV, "0")
    provider = build_provider(moe)
    assert type(provider) is FlashInferFusion and not hasattr(provider, "can_defer_finalize")
    monkeypatch.setenv(eligibility.ENABLE_ENV, "0")
    assert all(build_provider(d) is None for d in stage_descriptions(SETTINGS))


def test_settings_reject_a_bad_token_limit(monkeypatch):
    assert settings().max_tokens == 2048 and settings().launch_with_pdl and settings().fp32_acc
    monkeypatch.setenv(eligibility.MAX_TOKENS_ENV, "many")
    with pytest.raises(ValueError, match="LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS='many' is not an integer"):
        settings()
    monkeypatch.setenv(eligibility.MAX_TOKENS_ENV, "512")
    assert settings().max_tokens == 512


@pytest.mark.parametrize("capability,ok", [((9, 0), True), ((10, 0), True), ((10, 3), True), ((8, 0), False), ((12, 0), False)])
def test_only_hopper_and_blackwell_qualify(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(eligibility, "flashinfer_installed", lambda: True)
    reason = device_reason("cuda:0")
    assert (reason is None) == ok, reason
    if not ok:
        assert "neither Hopper" in reason


def test_no_cuda_is_a_device_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_reason(None) == "no CUDA device"


def test_widths_the_kernels_take():
    assert eligibility.width_reason(4096) is None and eligibility.width_reason(8192) is None
    assert "multiple of 8" in eligibility.width_reason(4100)
    assert "exceeds" in eligibility.width_reason(65536 + 8)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("hidden", [4096, 8192])
def test_the_oneshot_choice_is_flashinfers_except_where_two_shot_cannot_run(world, hidden):
    trtllm_ar = pytest.importorskip("flashinfer.comm.trtllm_ar")
    table = oneshot_table(2048, hidden, torch.bfloat16, world)
    for tokens in range(1, 2049):
        theirs = trtllm_ar._should_use_oneshot(tokens, hidden, torch.bfloat16, world)
        expected = theirs or tokens <= world  # two-shot asserts token_num > world_size
        assert table[tokens] == expected, tokens


def test_sixteen_ranks_and_huge_messages():
    table = oneshot_table(200, 4096, torch.bfloat16, 16)
    assert table[128] and not table[129]  # no flashinfer entry for 16 ranks: the 128-token guidance
    big = MAX_COMM_SIZE // (65536 * 2 * 2) + 1
    assert not oneshot_table(big, 65536, torch.bfloat16, 2)[big]  # a Lamport buffer cannot hold it


def test_workspace_size_matches_the_trtllm_layout():
    # TP=2, hidden 8192, 2048 tokens, bf16: a 64 MiB two-shot buffer, flags and 3 x 64 MiB Lamport,
    # each followed by a 2 KiB signal pad and rounded to the 2 MiB granularity: 66 + 2 + 194 MiB
    assert workspace_bytes(WorkspaceSpec(2048, 8192, torch.bfloat16), 2) == 262 * 2**20
    assert workspace_bytes(WorkspaceSpec(2048, 4096, torch.float32), 2) == 262 * 2**20
    # a buffer that is an exact multiple of the granularity still gets its pad
    assert workspace_bytes(WorkspaceSpec(64, 64, torch.bfloat16), 2) == 3 * 2 * 2**20
    assert workspace_bytes(WorkspaceSpec(2048, 8192, torch.bfloat16), 2, granularity=1) == (
        (64 * 2**20 + 2048) + (2048 + 2048) + (192 * 2**20 + 2048))
    assert WorkspaceSpec(2048, 8192, torch.bfloat16).capacity(4096) == 4096


@pytest.mark.parametrize("hidden,dtype,ok", [
    (64, torch.bfloat16, True), (4096, torch.bfloat16, True), (2880, torch.bfloat16, True), (65536, torch.bfloat16, True),
    (32768, torch.float32, True), (32776, torch.float32, False), (4100, torch.bfloat16, False), (4098, torch.float32, False),
    (65528, torch.bfloat16, False),  # 8191 vectors: no factor 2, one block of 8191 threads
])
def test_the_all_reduce_kernels_width_limits_per_dtype(hidden, dtype, ok):
    assert (eligibility.kernel_width_reason(hidden, dtype) is None) is ok


@pytest.mark.parametrize("hidden,dtype,why", [
    (4096, torch.bfloat16, None), (2048, torch.float16, None), (7168, torch.bfloat16, None), (256, torch.bfloat16, None),
    (64, torch.bfloat16, "not a multiple of 32"), (2880, torch.bfloat16, "not a multiple of 32"),
    (4096, torch.float32, "no torch.float32 variant"), (32768, torch.float32, "no torch.float32 variant"),
])
def test_the_finalize_kernel_is_declined_where_it_computes_wrong_values_or_has_no_variant(hidden, dtype, why):
    reason = eligibility.finalize_kernel_reason(hidden, dtype)
    assert (reason is None) if why is None else why in reason


def test_the_real_backend_applies_the_kernel_rules():
    from layer_boundary_flashinfer.backend import FlashInferBackend

    backend = FlashInferBackend()
    assert backend.finalize_reason(64, torch.bfloat16) and backend.finalize_reason(4096, torch.float32)
    assert "reads its peers' Lamport buffers" in backend.finalize_reason(4096, torch.bfloat16)
    assert backend.width_reason(32776, torch.float32) and backend.width_reason(4096, torch.float32) is None


def test_the_finalize_kernel_runs_only_with_a_flashinfer_verified_to_read_its_own_buffer(monkeypatch):
    assert "FlashInfer 0.7.2.post1's fused MoE finalize" in eligibility.finalize_kernel_version_reason("0.7.2.post1")
    assert "(unknown version)" in eligibility.finalize_kernel_version_reason(None)
    monkeypatch.setattr(eligibility, "FINALIZE_KERNEL_SAFE_VERSIONS", ("9.9.9",))
    assert eligibility.finalize_kernel_version_reason("9.9.9") is None


def test_flashinfers_finalize_kernel_still_reads_the_buffers_the_next_call_clears():
    """The installed FlashInfer's one-shot kernels: the all-reduce kernels read the peers' rows
    from this rank's own Lamport buffer, which only this rank clears (after it is done with it);
    the finalize kernel reads them from each peer's buffer, which that peer clears at its next
    call, while this rank may still be reading. If this fails, FlashInfer changed the kernel:
    verify the finalize on a GPU (scripts/gpu_tests.sh) and list the version as safe."""
    flashinfer = pytest.importorskip("flashinfer")
    from pathlib import Path

    header = Path(flashinfer.__file__).parent / "data" / "include" / "flashinfer" / "comm" / "trtllm_moe_allreduce_fusion.cuh"
    text = header.read_text()
    finalize = text[text.index("moefinalize_allreduce_fusion_kernel_oneshot_lamport("):]
    finalize = finalize[: finalize.index("cudaTriggerProgrammaticLaunchCompletion")]
    assert "load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[r])" in finalize
    reduce_kernel = text[text.index("moereduce_allreduce_fusion_kernel_oneshot_lamport("):]
    assert "load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[params.rank])" in reduce_kernel[:6000]
    assert flashinfer.__version__ not in eligibility.FINALIZE_KERNEL_SAFE_VERSIONS


@pytest.mark.parametrize("world", [2, 4])
def test_the_algorithm_setting_forces_two_shot_where_the_kernels_allow_it(world, monkeypatch):
    two = oneshot_table(300, 4096, torch.bfloat16, world, "twoshot")
    assert all(two[t] for t in range(1, world + 1)) and not any(two[world + 1:])  # two-shot needs tokens > ranks
    one = oneshot_table(300, 4096, torch.bfloat16, world, "oneshot")
    assert all(one)
    big = MAX_COMM_SIZE // (4096 * 2 * world) + 1
    assert not oneshot_table(big, 4096, torch.bfloat16, world, "oneshot")[big]  # past one Lamport buffer
    monkeypatch.setenv(eligibility.ONESHOT_ENV, "twoshot")
    assert settings().algorithm == "twoshot"
    monkeypatch.setenv(eligibility.ONESHOT_ENV, "sometimes")
    with pytest.raises(ValueError, match="choose one of auto, oneshot, twoshot"):
        settings()
