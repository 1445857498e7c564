"""The flashinfer plugin's rope and decode attention on the GPU (group `decode-kernels` of
scripts/gpu_tests.sh) against the core's torch path: each kernel alone against a float32
reference, then a qwen3 (head_dim 128) static-cache run with `prepare_model` choosing them:
logits against the torch path, a CUDA graph of the decode step equal to its eager step,
torch.compile(fullgraph) through the custom ops, and fewer kernels a step."""

import pytest
import torch

from layer_boundary import prepare_model, release_model
from layer_boundary.bench.profile import profile_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

flashinfer = pytest.importorskip("flashinfer")
decode_kernels = pytest.importorskip("layer_boundary_flashinfer.decode_kernels")

from flashinfer_static_decode import StaticDecode, qwen3, rel  # noqa: E402
from layer_boundary.plugin import DecodeAttentionRequest, RopeRequest  # noqa: E402

HEADS, KV_HEADS, D = 8, 2, 128


def _rope_request(max_positions=256):
    return RopeRequest(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=D, heads=HEADS, kv_heads=KV_HEADS,
                       theta=1e6, max_positions=max_positions)


def _decode_request():
    return DecodeAttentionRequest(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=D, heads=HEADS, kv_heads=KV_HEADS,
                                  scaling=D**-0.5)


@torch.inference_mode()
def test_rope_kernel_matches_the_torch_rotation():
    from layer_boundary_models.attention import RotaryEmbedding, apply_rotary

    kernel = decode_kernels.rope_factory(_rope_request())
    assert kernel is not None, "flashinfer.rope declined on this GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(5, HEADS, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(5, KV_HEADS, D, device="cuda", generator=gen).bfloat16()
    positions = torch.tensor([0, 3, 17, 100, 255], device="cuda")
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = kernel(q, k, positions)
    assert torch.equal(q, q_in) and torch.equal(k, k_in), "the kernel wrote its inputs"
    rotary = RotaryEmbedding(D, 1e6).cuda()
    cos32, sin32 = rotary(positions, torch.float32)
    want_q, want_k = apply_rotary(q.float(), cos32, sin32), apply_rotary(k.float(), cos32, sin32)
    cos, sin = rotary(positions, torch.bfloat16)
    torch_q = apply_rotary(q, cos, sin)
    assert rel(got_q, want_q) < 1e-2 and rel(got_k, want_k) < 1e-2
    assert rel(got_q, torch_q) < 2e-2


def _torch_decode(q, k_cache, v_cache, slots, positions):
    """The float32 reference: every row against its slot up to its position."""
    groups = HEADS // KV_HEADS
    rows = torch.arange(q.shape[0], device=q.device) if slots is None else slots
    keys = k_cache[rows].float().repeat_interleave(groups, dim=1)
    values = v_cache[rows].float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,thld->thl", q.float(), keys) * D**-0.5
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thl,thld->thd", torch.softmax(scores, dim=-1), values)


@pytest.mark.parametrize("cache_len", [48, 520, 8208], ids=["cuda_cores", "tensor_cores_no_split", "tensor_cores_split"])
@pytest.mark.parametrize("slots_given", [False, True], ids=["rows_are_slots", "slots_given"])
@torch.inference_mode()
def test_decode_attention_kernel_matches_the_reference(slots_given, cache_len):
    kernel = decode_kernels.decode_attention_factory(_decode_request())
    assert kernel is not None, "flashinfer.decode_attention declined on this GPU"
    assert decode_kernels.uses_tensor_cores(6, cache_len) == (cache_len >= 520)
    assert decode_kernels.splits_kv(6, cache_len) == (cache_len == 8208)
    gen = torch.Generator(device="cuda").manual_seed(1)
    cache_shape = (6, KV_HEADS, cache_len, D)
    k_cache = torch.randn(cache_shape, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(cache_shape, device="cuda", generator=gen).bfloat16()
    batch = 3 if slots_given else 6
    slots = torch.tensor([5, 0, 2], device="cuda") if slots_given else None
    positions = torch.tensor([0, 20, cache_len - 1, 7, 33, 1][:batch], device="cuda")
    q = torch.randn(batch, HEADS, D, device="cuda", generator=gen).bfloat16()
    got = kernel(q, k_cache, v_cache, slots, positions)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert rel(got, _torch_decode(q, k_cache, v_cache, slots, positions)) < 2e-2
    # the CUDA-core plan is made outside CUDA-graph mode, over the plan's own buffers: one launch,
    # no merge; the split tensor-core plan merges in a second launch
    planned = kernel._planned(batch, k_cache, slots_given)
    assert planned.graph_mode == decode_kernels.uses_tensor_cores(batch, cache_len)
    launched = profile_step(lambda: kernel(q, k_cache, v_cache, slots, positions), top=50)["by_name"]
    merges = sum(count for name, count in launched if "Merge" in name)
    assert merges == (1 if decode_kernels.splits_kv(batch, cache_len) else 0), launched
    # other lengths, same plan: the lengths are read at run time
    later = positions.flip(0)
    assert rel(kernel(q, k_cache, v_cache, slots, later), _torch_decode(q, k_cache, v_cache, slots, later)) < 2e-2


@pytest.mark.parametrize("cache_len", [48, 520], ids=["cuda_cores", "tensor_cores"])
@pytest.mark.parametrize("slots_given", [False, True], ids=["rows_are_slots", "slots_given"])
@torch.inference_mode()
def test_step_bound_write_fills_the_cache_index_put_fills_and_attends_the_same(slots_given, cache_len):
    """`bind_step` once, then `write` (one append_paged_kv_cache for keys and values, v strided
    as a fused projection leaves it) and `attend`: the cache equals the core's `index_put_`
    write bitwise, the output equals the per-call kernel's, and a CUDA graph of bind + write +
    attend replays them for new positions."""
    from layer_boundary.plugin import DecodeLayout
    from layer_boundary_models.attention import StaticKVCache

    kernel = decode_kernels.decode_attention_factory(_decode_request())
    assert kernel is not None, "flashinfer.decode_attention declined on this GPU"
    gen = torch.Generator(device="cuda").manual_seed(2)
    cache = StaticKVCache(2, 6, cache_len, KV_HEADS, D, dtype=torch.bfloat16, device="cuda")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, device="cuda", generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, device="cuda", generator=gen))
    cache.k[1].copy_(cache.k[0])  # layer 1 starts as layer 0: the two writes are then compared whole
    cache.v[1].copy_(cache.v[0])
    batch = 3 if slots_given else 6
    slots = torch.tensor([5, 0, 2], device="cuda") if slots_given else None
    positions = torch.tensor([0, 20, cache_len - 1, 7, 33, 1][:batch], device="cuda")
    fused = torch.randn(batch, (HEADS + 2 * KV_HEADS) * D, device="cuda", generator=gen).bfloat16()
    q, k, v = fused.split((HEADS * D, KV_HEADS * D, KV_HEADS * D), dim=-1)
    q, k, v = q.reshape(batch, HEADS, D), k.contiguous().view(batch, KV_HEADS, D), v.view(batch, KV_HEADS, D)
    cache.write_decode(0, cache.bind(DecodeLayout(slots, positions)), k, v)
    step = cache.bind(DecodeLayout(slots, positions), kernel)
    assert step.write_index is None and step.kernel_state is not None
    kernel.write(step.kernel_state, k, v, cache.k[1], cache.v[1])
    assert torch.equal(cache.k[0], cache.k[1]) and torch.equal(cache.v[0], cache.v[1])
    got = kernel.attend(step.kernel_state, q, cache.k[1], cache.v[1])
    assert torch.equal(got, kernel(q, cache.k[0], cache.v[0], slots, positions))
    # captured: bind + write + attend replay for other positions
    step_pos = positions.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state = cache.bind(DecodeLayout(slots, step_pos), kernel).kernel_state
        kernel.write(state, k, v, cache.k[1], cache.v[1])
        out = kernel.attend(state, q, cache.k[1], cache.v[1])
    later = positions.flip(0)
    step_pos.copy_(later)
    graph.replay()
    cache.write_decode(0, cache.bind(DecodeLayout(slots, later)), k, v)
    assert torch.equal(cache.k[0], cache.k[1]) and torch.equal(cache.v[0], cache.v[1])
    assert rel(out, _torch_decode(q, cache.k[0], cache.v[0], slots, later)) < 2e-2


@torch.inference_mode()
def test_qwen3_static_decode_runs_the_kernels_and_matches_the_torch_path():
    config, model = qwen3(head_dim=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    run = StaticDecode(config, model)
    torch_cache = run.new_cache()
    want = run.logits(torch_cache)
    torch_profile = profile_step(lambda: run.step(torch_cache, run.ids, run.base))

    prepare_model(model, max_tokens=64)
    chosen = model.attention_kernels
    assert (chosen.rope.name, chosen.decode_attention.name) == ("flashinfer.rope", "flashinfer.decode_attention")
    cache = run.new_cache()
    worst = max(rel(g, w) for g, w in zip(run.logits(cache), want))
    assert worst < 3e-2, f"logits with the flashinfer kernels differ by {worst:.3e} relative (bf16 bar 3e-2)"

    kernel_profile = profile_step(lambda: run.step(cache, run.ids, run.base))
    print(f"decode step kernels: torch path {torch_profile['kernels']} ({torch_profile['kernel_us']:.1f} us) -> "
          f"flashinfer {kernel_profile['kernels']} ({kernel_profile['kernel_us']:.1f} us)")
    assert kernel_profile["kernels"] < torch_profile["kernels"], (torch_profile, kernel_profile)
    run.assert_replay_equals_eager(cache)
    release_model(model)


@torch.inference_mode()
def test_compiled_decode_through_the_custom_ops_equals_eager():
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.compiling import CountingBackend, graph_breaks, reset_graph_breaks
    from layer_boundary.plugin import DecodeLayout

    torch._dynamo.reset()
    reset_graph_breaks()
    config, model = qwen3(head_dim=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    prepare_model(model, max_tokens=64)
    run = StaticDecode(config, model, batch=2, steps=2, seed=5)
    cache = run.new_cache()
    run.prefill(cache)
    compiled_model = torch.compile(model, backend=CountingBackend("aot_eager"), fullgraph=True)
    for s, tokens in enumerate(run.decode):
        ids = torch.tensor(tokens, device="cuda")
        snap = cache.snapshot()
        eager = run.step(cache, ids, run.base + s).clone()
        cache.restore(snap)
        compiled = compiled_model(ids, Forward(run.parallel, len(tokens), mode=ForwardMode.DECODE), DecodeLayout(None, run.base + s), cache)
        assert rel(compiled, eager) < 1e-2
    assert graph_breaks() == 0
    release_model(model)
