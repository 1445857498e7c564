"""The q/k norm + rope kernel of the reference attention (`QKNormRopeKernel`): asked only for
attentions with q/k norms (Qwen3's), chosen with the rope and decode-attention kernels in one
rank-agreed choice at `prepare_model`, shown in plans, and on the static-cache path called once
per layer in place of both norms and the rotation, the logits equal to the torch path's. The
kernels are torch-implemented stubs registered inline (the helpers of test_attention_kernels)."""

import threading

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology, prepare_model, release_model
from layer_boundary_models import build_model, family, model_config
from layer_boundary_models import kernel_choice
from layer_boundary_models.attention import KernelRope, RotaryEmbedding, TPAttention, apply_rotary
from layer_boundary_models.attention_kernels import TORCH, describe
from layer_boundary.cli.static_decode import static_prefill
from layer_boundary.plugin import StateDictSource
from layer_boundary.plugin import QKNormRopeKernel, QKNormRopeRequest, get_registry, hookimpl
from layer_boundary.testing.threaded import run_threaded

from compiled_decode import call_nodes, compiled_decode_graph, reset_compiler

from test_attention_kernels import StubKernels, _Discard, _model, _static_run


def _normalized(x, weight, eps):
    """The core's RMSNorm (`RMSNorm.torch_forward`), written out: the statistic in fp32, the
    normalized row rounded to x's dtype, then times the plain weight."""
    xc = x.to(torch.float32)
    return weight * (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def stub_qk_norm_rope(calls, request, skew=0.0):
    """Both norms, then the rotation the torch path runs (`apply_rotary`), with (cos, sin) from a
    table built as the core builds the static cache's (`RotaryEmbedding.table`), for the whole of
    `request.max_positions`: the same ops as the torch path, so its results are bit-identical.
    `skew` adds to the epsilon (a kernel that computes something slightly different)."""
    table = RotaryEmbedding(request.head_dim, request.theta).table(request.max_positions, request.dtype, request.device)
    eps = request.eps + skew

    def run(q, k, positions, q_weight, k_weight):
        calls.append(("qk_norm_rope", tuple(q.shape), tuple(k.shape), q.is_contiguous()))
        both = table.index_select(0, positions)
        cos, sin = both[:, 0], both[:, 1]
        return apply_rotary(_normalized(q, q_weight, eps), cos, sin), apply_rotary(_normalized(k, k_weight, eps), cos, sin)

    return run


class StubQKNormRope:
    """An inline plugin offering a `QKNormRopeKernel`; `accepts(request)` decides (per rank)."""

    def __init__(self, accepts=lambda request: True, prefix="stub", record=True, skew=0.0, kernel=stub_qk_norm_rope):
        self.calls, self.requests = [], []
        calls, requests = (self.calls if record else _Discard()), self.requests

        def factory(request):
            requests.append(request)
            return kernel(calls, request, skew) if accepts(request) else None

        self.record = QKNormRopeKernel(name=f"{prefix}.qk_norm_rope", factory=factory, priority=100, description="torch q/k norm + rope (tests)")

    @hookimpl
    def layer_boundary_qk_norm_rope_kernels(self):
        yield self.record


def _fused_calls(calls):
    return [c for c in calls if isinstance(c, tuple) and c[0] == "qk_norm_rope"]


def _count_norm_calls(model):
    """A list that grows by one per call of any attention's q_norm or k_norm."""
    seen = []
    for attention in (m for m in model.modules() if isinstance(m, TPAttention)):
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:
                norm.register_forward_hook(lambda *args: seen.append(1))
    return seen


def _recording_projections(monkeypatch):
    """A list that receives every attention's (q, k, v) after its norms and rope (`_project`)."""
    seen, project = [], TPAttention._project

    def recorded(self, x, rope):
        out = project(self, x, rope)
        seen.append(out)
        return out

    monkeypatch.setattr(TPAttention, "_project", recorded)
    return seen


def _model_without_qk_norms(dtype=torch.float64):
    """Qwen3 without its q/k norms (a Llama-shaped decoder)."""
    config = attrs.evolve(model_config("qwen3"), qk_norm=False)
    model = build_model(config, Parallel.single(), dtype=dtype)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, dtype, seed=5)))
    return config, model.eval()


def test_the_record_is_a_public_hook_chosen_installed_and_asked_once(fresh_registry, inline_plugin):
    stub = inline_plugin(StubQKNormRope(), name="stub")
    assert [r.name for r in get_registry().qk_norm_rope_kernels if r.plugin == "stub"] == ["stub.qk_norm_rope"]
    with pytest.raises(ValueError, match="dotted"):
        QKNormRopeKernel(name="nodot", factory=lambda request: None)
    config, model = _model()
    prepare_model(model, max_tokens=16)
    chosen = model.attention_kernels
    assert chosen.qk_norm_rope.name == "stub.qk_norm_rope" and chosen.rope.name == TORCH
    attentions = [m for m in model.modules() if isinstance(m, TPAttention)]
    assert len(attentions) == config.num_layers
    assert all(a.qk_norm_rope_kernel is chosen.qk_norm_rope.kernel is not None for a in attentions)
    # one request for the whole model, with the geometry and the norms' epsilon
    (request,) = stub.requests
    assert isinstance(request, QKNormRopeRequest)
    assert (request.head_dim, request.heads, request.kv_heads) == (config.head_dim, config.num_heads, config.num_kv_heads)
    assert request.eps == attentions[0].q_norm.eps == config.rms_norm_eps and request.theta == config.rope_theta
    assert request.max_positions == config.hf["max_position_embeddings"] and request.dtype == torch.float64
    release_model(model)
    assert all(a.qk_norm_rope_kernel is None for a in attentions)


@pytest.mark.parametrize("with_rope_kernels", [False, True], ids=["fused_only", "with_rope_and_decode_kernels"])
@pytest.mark.parametrize("slots_given", [False, True], ids=["rows_are_slots", "slots_gathered"])
def test_the_static_path_runs_the_fused_kernel_once_per_layer_and_stays_equal(
    fresh_registry, inline_plugin, monkeypatch, slots_given, with_rope_kernels
):
    """In place of both norms and the rope (the rope kernel is not called where both are chosen);
    every layer's queries and keys and the logits are bit-identical (torch.equal): the stub runs
    the torch path's own ops on the same values. (The queries are compared directly: the
    attention's fp32 softmax would hide a difference below fp32 precision from the logits.)"""
    config, model = _model()
    projected = _recording_projections(monkeypatch)
    want = _static_run(model, slots_given)  # the torch path (no prepare_model yet)
    want_projected = list(projected)
    projected.clear()
    stub = inline_plugin(StubQKNormRope(), name="stub")
    others = inline_plugin(StubKernels(), name="others") if with_rope_kernels else None
    prepare_model(model, max_tokens=16)
    norms = _count_norm_calls(model)
    got = _static_run(model, slots_given)
    assert len(projected) == len(want_projected) == config.num_layers * len(got)
    for a, b in zip(want_projected, projected):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), max((x - y).abs().max() for x, y in zip(a, b))
    layers, steps = config.num_layers, len(got) - 1
    calls = _fused_calls(stub.calls)
    assert len(calls) == layers * (1 + steps)  # the prefill and every decode step, every layer
    assert norms == []  # the fused kernel replaced both norms
    # the prefill's 3 requests of 5 tokens, then 3 rows per decode step; q and k are views of the
    # fused q/k/v projection's output
    T = 15
    assert calls[0] == ("qk_norm_rope", (T, config.num_heads, config.head_dim), (T, config.num_kv_heads, config.head_dim), False)
    assert calls[-1][1:3] == ((3, config.num_heads, config.head_dim), (3, config.num_kv_heads, config.head_dim))
    if with_rope_kernels:
        assert model.attention_kernels.rope.name == "stub.rope"
        assert others.calls.count("rope") == 0 and others.calls.count("decode") == layers * steps
        # the decode stub's softmax sums the row's own length (see test_attention_kernels)
        assert torch.equal(want[0], got[0])
        for a, b in zip(want[1:], got[1:]):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    else:
        assert model.attention_kernels.rope.name == TORCH
        for a, b in zip(want, got):
            assert torch.equal(a, b), (a - b).abs().max()
    release_model(model)
    stub.calls.clear()
    assert torch.equal(_static_run(model, slots_given)[-1], want[-1]) and stub.calls == []  # released: torch again


def test_q_and_k_addends_are_added_before_the_fused_norms(fresh_registry, inline_plugin):
    """LoRA's q/k deltas (`q_addend`, `k_addend`, added in `_qkv`) reach the fused kernel as they
    reach the torch norms: the logits stay bit-identical."""
    config, model = _model()
    plain = _static_run(model, True)
    gen = torch.Generator().manual_seed(7)
    for attention in (m for m in model.modules() if isinstance(m, TPAttention)):
        for name, width in (("q_addend", attention.q_width), ("k_addend", attention.kv_width)):
            delta = torch.nn.Linear(config.hidden_size, width, bias=False, dtype=torch.float64)
            torch.nn.init.normal_(delta.weight, std=0.05, generator=gen)
            setattr(attention, name, delta)
    want = _static_run(model, True)
    assert not torch.allclose(plain[-1], want[-1])  # the deltas matter
    stub = inline_plugin(StubQKNormRope(), name="stub")
    prepare_model(model, max_tokens=16)
    got = _static_run(model, True)
    assert len(_fused_calls(stub.calls)) == config.num_layers * len(got)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_model_without_qk_norms_never_asks_the_record(fresh_registry, inline_plugin):
    stub = inline_plugin(StubQKNormRope(), name="stub")
    others = inline_plugin(StubKernels(), name="others")
    config, model = _model_without_qk_norms()
    want = _static_run(model, False)
    prepare_model(model, max_tokens=16)
    chosen = model.attention_kernels
    assert stub.requests == [] and chosen.qk_norm_rope == kernel_choice.KernelChoice(TORCH)
    assert chosen.rope.name == "stub.rope"  # the other kinds are chosen as before
    assert all(a.qk_norm_rope_kernel is None for a in model.modules() if isinstance(a, TPAttention))
    got = _static_run(model, False)
    assert stub.calls == [] and others.calls.count("rope") == config.num_layers * len(got)
    assert torch.allclose(want[0], got[0], rtol=0, atol=1e-10)
    assert "qk norm + rope" not in describe(model)


def test_a_cache_longer_than_the_rope_table_keeps_the_unfused_path(fresh_registry, inline_plugin):
    stub = inline_plugin(StubQKNormRope(), name="stub")
    config, model = _model()
    prepare_model(model, max_tokens=16)
    norms = _count_norm_calls(model)
    cache = model.new_static_cache(1, config.hf["max_position_embeddings"] + 1)
    with torch.inference_mode():
        static_prefill(model, Parallel.single(), cache, [[1, 2, 3]], "cpu")
    assert _fused_calls(stub.calls) == [] and len(norms) == 2 * config.num_layers


def test_a_kernel_rope_without_a_rope_kernel_rotates_with_the_cache_table(fresh_registry):
    """Where only the fused kernel is chosen the layers get a KernelRope with no rope kernel:
    calling it (nothing in the core does) rotates as the torch path does."""
    _, model = _model()
    cache = model.new_static_cache(2, 16)
    positions = torch.tensor([3, 0, 15])
    q, k = torch.randn(3, 4, cache.head_dim, dtype=torch.float64), torch.randn(3, 2, cache.head_dim, dtype=torch.float64)
    cos, sin = cache.rope(positions)
    got = KernelRope(None, positions, fused=object(), table=cache.rope_table)(q, k)
    assert torch.equal(got[0], apply_rotary(q, cos, sin)) and torch.equal(got[1], apply_rotary(k, cos, sin))
    with pytest.raises(ValueError, match="rope table"):
        KernelRope(None, positions)


def test_the_choice_is_agreed_across_the_tp_group_in_one_all_reduce(fresh_registry, inline_plugin, monkeypatch):
    """A record only rank 1 accepts runs on no rank; one both accept runs on both; the rope,
    decode and fused kinds are agreed by one all_reduce per rank (one `choose` of three asks)."""
    from layer_boundary._plugins import selection
    from layer_boundary_models import attention_kernels

    ranks, agreements, rounds = {}, [], []
    agree, choose = selection._agree, attention_kernels.choose

    def counted_agree(flags, group, device):
        agreements.append(threading.get_ident())
        return agree(flags, group, device)

    def counted_choose(asks, group, device):
        before = agreements.count(threading.get_ident())
        out = choose(asks, group, device)
        rounds.append((ranks[threading.get_ident()], len(asks), agreements.count(threading.get_ident()) - before))
        return out

    monkeypatch.setattr(selection, "_agree", counted_agree)
    monkeypatch.setattr(attention_kernels, "choose", counted_choose)

    def run(parallel):
        ranks[threading.get_ident()] = parallel.rank
        _, model = _model(parallel=parallel)
        prepare_model(model, max_tokens=16)
        chosen = model.attention_kernels
        # the stubs' declines (an installed GPU plugin's record declines on this CPU as well)
        declined = tuple(n for n in chosen.qk_norm_rope.declined if n.startswith(("rank_one.", "zz_")))
        return chosen.qk_norm_rope.name, declined, chosen.rope.name

    only_rank_one = lambda request: ranks.get(threading.get_ident()) == 1  # noqa: E731
    inline_plugin(StubQKNormRope(only_rank_one, prefix="rank_one"), name="rank_one")
    assert run_threaded(run, Topology(tp=2)) == [(TORCH, ("rank_one.qk_norm_rope",), TORCH)] * 2
    inline_plugin(StubQKNormRope(prefix="zz_everyone"), name="everyone")
    inline_plugin(StubKernels(prefix="zz_rope"), name="rope")
    rounds.clear()
    # rank_one sorts first (same priority, by name): declined by rank 0, so both take zz_everyone
    want = ("zz_everyone.qk_norm_rope", ("rank_one.qk_norm_rope",), "zz_rope.rope")
    assert run_threaded(run, Topology(tp=2)) == [want] * 2
    # each rank: one choose of the three kinds, one all_reduce in it
    assert sorted(rounds) == [(0, 3, 1), (1, 3, 1)]


def test_plan_names_the_chain_and_the_choice(fresh_registry, inline_plugin, capsys):
    from layer_boundary.cli.main import main

    inline_plugin(StubQKNormRope(), name="stub")
    _, model = _model(dtype=torch.float32)
    line = describe(model)
    # (an installed GPU plugin's record may come first in the chain, declined on this CPU)
    assert "qk norm + rope: stub.qk_norm_rope (" in line and "stub.qk_norm_rope > core.torch)" in line and "this rank's answer" in line
    prepare_model(model, max_tokens=16)
    line = describe(model)
    assert "agreed across the TP group" in line and "qk norm + rope: stub.qk_norm_rope (" in line
    assert main(["plan", "--model", "qwen3", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention kernels (static cache): chosen on the device at prepare_model" in out
    assert "qk norm + rope: chain " in out and "stub.qk_norm_rope > core.torch" in out


@torch.library.custom_op("layer_boundary_tests::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, table: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    both = table.index_select(0, positions)
    cos, sin = both[:, 0], both[:, 1]
    return apply_rotary(_normalized(q, q_weight, eps), cos, sin), apply_rotary(_normalized(k, k_weight, eps), cos, sin)


@_qk_norm_rope_op.register_fake
def _(q, k, positions, q_weight, k_weight, table, eps):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def custom_op_qk_norm_rope(calls, request, skew=0.0):
    """The stub as a plugin ships it: one custom op (opaque to the compiler), its table built here."""
    table = RotaryEmbedding(request.head_dim, request.theta).table(request.max_positions, request.dtype, request.device)

    def run(q, k, positions, q_weight, k_weight):
        return torch.ops.layer_boundary_tests.qk_norm_rope(q, k, positions, q_weight, k_weight, table, request.eps + skew)

    return run


@torch.inference_mode()
def test_the_fused_kernel_traces_whole_under_torch_compile(fresh_registry, inline_plugin):
    reset_compiler()
    inline_plugin(StubQKNormRope(record=False, kernel=custom_op_qk_norm_rope), name="stub")
    config, model = _model()
    graph = compiled_decode_graph(model, config)
    ops = call_nodes(graph, lambda target: "layer_boundary_tests.qk_norm_rope" in str(target))
    assert len(ops) == config.num_layers  # once per layer, in place of both norms and the rope


def test_norm_weights_of_another_dtype_never_ask_the_record(fresh_registry, inline_plugin):
    """The request carries one dtype (the attention's): q/k norm weights kept in another (fp32
    norms in a float64 model here) keep the torch norms instead of failing at the first forward."""
    stub = inline_plugin(StubQKNormRope(), name="stub")
    _, model = _model()
    for attention in (m for m in model.modules() if isinstance(m, TPAttention)):
        attention.q_norm.weight.data = attention.q_norm.weight.data.float()
        attention.k_norm.weight.data = attention.k_norm.weight.data.float()
    prepare_model(model, max_tokens=16)
    assert stub.requests == [] and model.attention_kernels.qk_norm_rope == kernel_choice.KernelChoice(TORCH)
