"""The rope and decode-attention kernels of the reference attention (`RopeKernel`,
`DecodeAttentionKernel`): chosen once per model at `prepare_model`, agreed across the TP group,
shown in plans, and on the static-cache path the model routes through them and stays equal to
its torch path. The kernels here are torch-implemented stubs registered inline."""

import pytest
import torch

from layer_boundary import Parallel, Topology, prepare_model, release_model
from layer_boundary_models import build_model, family, model_config
from layer_boundary_models.attention_kernels import TORCH, describe
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary.cli.runner import make_requests
from layer_boundary.plugin import StateDictSource
from layer_boundary.plugin import DecodeAttentionKernel, DecodeAttentionRequest, RopeKernel, RopeRequest, get_registry, hookimpl
from layer_boundary.testing.threaded import run_threaded

from compiled_decode import call_nodes, compiled_decode_graph, reset_compiler


def stub_rope(calls, request):
    """The rotation as Hugging Face writes it (cat of the negated half), cos/sin computed here."""
    inv_freq = 1.0 / (request.theta ** (torch.arange(0, request.head_dim, 2, dtype=torch.float) / request.head_dim))

    def run(q, k, positions):
        calls.append("rope")
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        half = q.shape[-1] // 2

        def rotate(x):
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        return rotate(q), rotate(k)

    return run


def stub_decode(calls, request):
    """Every row against its slot's whole cache, later positions masked, the KV heads repeated
    over their query groups, fp32 softmax: no host sync (capturable, traceable)."""
    groups = request.heads // request.kv_heads

    def run(q, k_cache, v_cache, slots, positions):
        calls.append("decode")
        T = q.shape[0]
        keys = (k_cache[:T] if slots is None else k_cache[slots]).repeat_interleave(groups, dim=1)  # [T, heads, L, D]
        values = (v_cache[:T] if slots is None else v_cache[slots]).repeat_interleave(groups, dim=1)
        scores = torch.einsum("thd,thld->thl", q, keys) * request.scaling
        visible = torch.arange(keys.shape[2])[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("thl,thld->thd", probs, values)

    return run


class StepBoundDecode:
    """`stub_decode` as a step-bound kernel: `bind_step` once per step, then each layer's
    `write` (its keys and values into the cache, in place) and `attend`."""

    def __init__(self, calls, request):
        self.calls, self.attention = calls, stub_decode(calls, request)

    def __call__(self, q, k_cache, v_cache, slots, positions):
        return self.attention(q, k_cache, v_cache, slots, positions)

    def bind_step(self, k_cache, slots, positions):
        self.calls.append("bind_step")
        rows = torch.arange(positions.shape[0]) if slots is None else slots
        return rows, positions, slots

    def write(self, state, k, v, k_cache, v_cache):
        self.calls.append("write")
        rows, positions, _ = state
        k_cache[rows, :, positions] = k
        v_cache[rows, :, positions] = v

    def attend(self, state, q, k_cache, v_cache):
        _, positions, slots = state
        return self.attention(q, k_cache, v_cache, slots, positions)


class _Discard(list):
    """A call log that keeps nothing (a compiled region would guard on a growing list)."""

    def append(self, item):
        pass


class StubKernels:
    """An inline plugin offering both kernels; `accepts(rank)` decides per rank."""

    def __init__(self, accepts=lambda request: True, prefix="stub", record=True, step_bound=False):
        self.calls = []
        self.requests = []
        calls, requests = (self.calls if record else _Discard()), self.requests

        def rope(request):
            requests.append(request)
            return stub_rope(calls, request) if accepts(request) else None

        def decode(request):
            requests.append(request)
            if not accepts(request):
                return None
            return StepBoundDecode(calls, request) if step_bound else stub_decode(calls, request)

        self.rope = RopeKernel(name=f"{prefix}.rope", factory=rope, priority=100, description="torch rope (tests)")
        self.decode = DecodeAttentionKernel(name=f"{prefix}.decode_attention", factory=decode, priority=100, description="torch decode (tests)")

    @hookimpl
    def layer_boundary_rope_kernels(self):
        yield self.rope

    @hookimpl
    def layer_boundary_decode_attention_kernels(self):
        yield self.decode


def _model(dtype=torch.float64, parallel=None):
    config = model_config("qwen3")
    model = build_model(config, parallel or Parallel.single(), dtype=dtype)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, dtype, seed=5)))
    return config, model.eval()


@torch.inference_mode()
def _static_run(model, slots_given: bool):
    """Prefill 3 requests, then 3 decode steps: the logits of every step."""
    config, parallel = model.config, Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 3, 5, 3, seed=2)
    cache = model.new_static_cache(len(prompts), 16)
    out = [static_prefill(model, parallel, cache, prompts, "cpu")]
    requests = [2, 0, 1] if slots_given else [0, 1, 2]
    slots = torch.tensor(requests) if slots_given else None
    positions = torch.tensor([len(prompts[r]) for r in requests])
    for s, tokens in enumerate(decode):
        out.append(static_decode_step(model, parallel, cache, torch.tensor([tokens[r] for r in requests]), slots, positions + s))
    return out


def test_records_are_public_hooks_in_registry_order(fresh_registry, inline_plugin):
    inline_plugin(StubKernels(), name="stub")
    registry = get_registry()
    assert [r.name for r in registry.rope_kernels if r.plugin == "stub"] == ["stub.rope"]
    assert [r.name for r in registry.decode_attention_kernels if r.plugin == "stub"] == ["stub.decode_attention"]
    with pytest.raises(ValueError, match="dotted"):
        RopeKernel(name="nodot", factory=lambda request: None)


@pytest.mark.parametrize("slots_given", [False, True], ids=["rows_are_slots", "slots_gathered"])
def test_static_path_routes_through_the_kernels_and_stays_equal(fresh_registry, inline_plugin, slots_given):
    config, model = _model()
    want = _static_run(model, slots_given)  # the torch path (no prepare_model yet)
    stub = inline_plugin(StubKernels(), name="stub")
    prepare_model(model, max_tokens=16)
    chosen = model.attention_kernels
    assert (chosen.rope.name, chosen.decode_attention.name) == ("stub.rope", "stub.decode_attention")
    rope_request = next(r for r in stub.requests if isinstance(r, RopeRequest))
    decode_request = next(r for r in stub.requests if isinstance(r, DecodeAttentionRequest))
    assert (rope_request.head_dim, rope_request.heads, rope_request.kv_heads) == (config.head_dim, config.num_heads, config.num_kv_heads)
    assert rope_request.max_positions == config.hf["max_position_embeddings"] and decode_request.scaling == config.head_dim**-0.5
    # one request per kind for the whole model: chosen once, not per layer
    assert len(stub.requests) == 2
    got = _static_run(model, slots_given)
    layers, steps = config.num_layers, len(got) - 1
    assert stub.calls.count("rope") == layers * (1 + steps)  # prefill and every decode step, every layer
    assert stub.calls.count("decode") == layers * steps
    # prefill: the same float64 arithmetic up to rounding; decode: the stub's fp32 softmax sums
    # the row's own length, the torch path the padded cache length (fp32 precision, as against HF)
    assert torch.allclose(want[0], got[0], rtol=0, atol=1e-10), (want[0] - got[0]).abs().max()
    for a, b in zip(want[1:], got[1:]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    release_model(model)
    assert "attention_kernels" not in model.__dict__
    stub.calls.clear()
    _static_run(model, slots_given)
    assert stub.calls == []  # released: the torch path again


@pytest.mark.parametrize("slots_given", [False, True], ids=["rows_are_slots", "slots_gathered"])
def test_a_step_bound_kernel_writes_the_cache_itself_and_binds_once_per_step(fresh_registry, inline_plugin, slots_given):
    """With `bind_step`, the core neither computes a write index nor writes keys and values: the
    kernel is bound once per decode step (every layer shares it) and writes each layer's cache;
    the logits and the cache it leaves equal the torch path's."""
    config, model = _model()
    want = _static_run(model, slots_given)
    stub = inline_plugin(StubKernels(step_bound=True), name="stub")
    prepare_model(model, max_tokens=16)
    got = _static_run(model, slots_given)
    layers, steps = config.num_layers, len(got) - 1
    assert stub.calls.count("bind_step") == steps
    assert stub.calls.count("write") == layers * steps and stub.calls.count("decode") == layers * steps
    for a, b in zip(want[1:], got[1:]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    release_model(model)


def test_a_step_bound_kernel_fills_the_cache_the_torch_path_fills(fresh_registry, inline_plugin):
    from layer_boundary.plugin import DecodeLayout

    config, model = _model()
    cache = model.new_static_cache(3, 16)
    positions, slots = torch.tensor([4, 0, 9]), torch.tensor([2, 0, 1])
    k = torch.randn(3, cache.kv_heads, cache.head_dim, dtype=torch.float64)
    v = torch.randn(3, cache.kv_heads, cache.head_dim, dtype=torch.float64)
    cache.write_decode(0, cache.bind(DecodeLayout(slots, positions)), k, v)
    kernel = StepBoundDecode([], DecodeAttentionRequest(device=torch.device("cpu"), dtype=torch.float64, head_dim=cache.head_dim,
                                                        heads=config.num_heads, kv_heads=cache.kv_heads, scaling=1.0))
    step = cache.bind(DecodeLayout(slots, positions), kernel)
    assert step.write_index is None and step.key_bias is None and step.bound
    kernel.write(step.kernel_state, k, v, cache.k[1], cache.v[1])
    assert torch.equal(cache.k[0], cache.k[1]) and torch.equal(cache.v[0], cache.v[1])


def test_the_growing_cache_keeps_the_torch_path(fresh_registry, inline_plugin):
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.plugin import StepLayout

    stub = inline_plugin(StubKernels(), name="stub")
    _, model = _model()
    prepare_model(model, max_tokens=16)
    step = StepLayout([0], [4], [0])
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3, 4]), Forward(Parallel.single(), 4, mode=ForwardMode.EXTEND), step, model.new_cache())
    assert stub.calls == []


def test_a_cache_longer_than_the_rope_table_runs_torch_rope(fresh_registry, inline_plugin):
    stub = inline_plugin(StubKernels(), name="stub")
    config, model = _model()
    prepare_model(model, max_tokens=16)
    parallel = Parallel.single()
    cache = model.new_static_cache(1, config.hf["max_position_embeddings"] + 1)
    with torch.inference_mode():
        static_prefill(model, parallel, cache, [[1, 2, 3]], "cpu")
    assert stub.calls.count("rope") == 0


def test_without_an_accepting_record_the_torch_path_runs(fresh_registry, inline_plugin):
    stub = inline_plugin(StubKernels(accepts=lambda request: False), name="stub")
    _, model = _model()
    prepare_model(model, max_tokens=16)
    chosen = model.attention_kernels
    assert chosen.rope.name == TORCH and chosen.rope.declined[-1] == "stub.rope"
    _static_run(model, False)
    assert stub.calls == []


def _agreement(parallel):
    _, model = _model(parallel=parallel)
    prepare_model(model, max_tokens=16)
    return model.attention_kernels.rope.name, model.attention_kernels.decode_attention.name


def test_the_choice_is_agreed_across_the_tp_group(fresh_registry, inline_plugin):
    """A kernel only rank 1 accepts runs on no rank (its TP peer declined); one both accept runs on both."""
    import threading

    ranks = {}

    def run(parallel):
        ranks[threading.get_ident()] = parallel.rank
        return _agreement(parallel)

    inline_plugin(StubKernels(lambda request: ranks.get(threading.get_ident()) == 1, prefix="rank_one"), name="rank_one")
    inline_plugin(StubKernels(lambda request: True, prefix="zz_everyone"), name="everyone")
    # rank_one sorts first (same priority, by name): declined by rank 0, so both take zz_everyone
    assert run_threaded(run, Topology(tp=2)) == [("zz_everyone.rope", "zz_everyone.decode_attention")] * 2


def test_plan_names_the_chain_and_the_choice(fresh_registry, inline_plugin, capsys):
    from layer_boundary.cli.main import main

    inline_plugin(StubKernels(), name="stub")
    _, model = _model(dtype=torch.float32)
    line = describe(model)
    assert "rope: stub.rope (" in line and "stub.rope > core.torch)" in line and "this rank's answer" in line
    prepare_model(model, max_tokens=16)
    assert "agreed across the TP group" in describe(model)
    assert main(["plan", "--model", "qwen3", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention kernels (static cache): chosen on the device at prepare_model" in out
    assert "rope: chain " in out and "stub.rope > core.torch" in out


@pytest.mark.parametrize("step_bound", [False, True], ids=["attention_only", "step_bound"])
@torch.inference_mode()
def test_the_kernels_trace_whole_under_torch_compile(fresh_registry, inline_plugin, step_bound):
    reset_compiler()
    inline_plugin(StubKernels(record=False, step_bound=step_bound), name="stub")
    config, model = _model()
    graph = compiled_decode_graph(model, config)
    # the graph holds the stub's attention (einsum; the torch path has none), once per layer
    einsums = call_nodes(graph, lambda target: target is torch.einsum)
    assert len(einsums) == 2 * config.num_layers


def test_a_record_failing_on_one_rank_raises_on_every_rank_instead_of_hanging(fresh_registry, inline_plugin):
    """A factory that raises (or returns a non-callable) on rank 1 only: the failure is agreed with
    the acceptances, so both ranks raise at prepare_model; rank 0 is not left in the all_reduce."""
    import threading

    ranks = {}

    def accepts(request):
        if ranks.get(threading.get_ident()) == 1:
            raise RuntimeError("rank 1's library is broken")
        return True

    def run(parallel):
        ranks[threading.get_ident()] = parallel.rank
        try:
            _agreement(parallel)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    inline_plugin(StubKernels(accepts, prefix="flaky"), name="flaky")
    rank0, rank1 = run_threaded(run, Topology(tp=2))
    assert "flaky.rope" in rank1 and "rank 1's library is broken" in rank1
    assert "failed at prepare_model on another rank" in rank0
