"""The gated MLP's activation kernel (`GatedActivationKernel`): chosen once per model and width at
`prepare_model`, agreed across the TP group, shown in plans, installed on every `TPGatedMLP`
(and `LoraGatedMLP`), equal to the torch path, traced whole by torch.compile. The kernels here
are torch-implemented stubs registered inline."""

import pytest
import torch
from torch import nn

from layer_boundary import Parallel, Topology, prepare_model, release_model
from layer_boundary_models import build_model, family, model_config
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary_models.kernel_choice import TORCH
from layer_boundary_models.mlp import TPGatedMLP
from layer_boundary_models.mlp_kernels import describe
from layer_boundary.cli.runner import make_requests
from layer_boundary.plugin import StateDictSource
from layer_boundary.plugin import GATED_ACTIVATIONS, GatedActivationKernel, GatedActivationRequest, get_registry, hookimpl
from layer_boundary.testing.threaded import run_threaded

from compiled_decode import call_nodes, compiled_decode_graph, reset_compiler


def same_ops(gate_up, d):
    """What the torch path computes, on the same two halves: a stub equal to it bit for bit."""
    gate, up = gate_up.split(d, dim=-1)
    return nn.functional.silu(gate) * up


def via_sigmoid(gate_up, d):
    """SiLU written out (x * sigmoid(x)): a stub whose ops a compiled graph shows."""
    gate, up = gate_up[:, :d], gate_up[:, d:]
    return gate * torch.sigmoid(gate) * up


class _Discard(list):
    """A call log that keeps nothing (a compiled region would guard on a growing list)."""

    def append(self, item):
        pass


class StubActivation:
    """An inline plugin offering one gated-activation record; `accepts(request)` decides."""

    def __init__(self, accepts=lambda request: True, prefix="stub", compute=same_ops, record=True):
        self.calls = [] if record else _Discard()
        self.requests = []
        calls, requests = self.calls, self.requests

        def factory(request):
            requests.append(request)
            if not accepts(request):
                return None
            d = request.intermediate

            def kernel(gate_up):
                calls.append(d)
                assert gate_up.shape[-1] == 2 * d
                return compute(gate_up, d)

            return kernel

        self.record = GatedActivationKernel(name=f"{prefix}.gated_activation", factory=factory, priority=100,
                                            description="torch act(gate) * up (tests)")

    @hookimpl
    def layer_boundary_gated_activation_kernels(self):
        yield self.record


def _model(dtype=torch.float64, parallel=None):
    config = model_config("qwen3")
    model = build_model(config, parallel or Parallel.single(), dtype=dtype)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, dtype, seed=5)))
    return config, model.eval()


@torch.inference_mode()
def _static_run(model):
    """Prefill 3 requests, then 3 decode steps: the logits of every step."""
    config, parallel = model.config, Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 3, 5, 3, seed=2)
    cache = model.new_static_cache(len(prompts), 16)
    out = [static_prefill(model, parallel, cache, prompts, "cpu")]
    positions = torch.tensor([len(p) for p in prompts])
    for s, tokens in enumerate(decode):
        out.append(static_decode_step(model, parallel, cache, torch.tensor(tokens), None, positions + s))
    return out


def test_the_record_is_a_public_hook_in_registry_order(fresh_registry, inline_plugin):
    inline_plugin(StubActivation(), name="stub")
    assert [r.name for r in get_registry().gated_activation_kernels if r.plugin == "stub"] == ["stub.gated_activation"]
    with pytest.raises(ValueError, match="dotted"):
        GatedActivationKernel(name="nodot", factory=lambda request: None)


def test_activation_names_are_the_plugin_apis():
    group = Parallel.single().groups["tp"]
    kinds = {act: TPGatedMLP(8, 16, group, act).act_kind for act in ("silu", "gelu_pytorch_tanh", "gelu_tanh", "gelu", "relu2")}
    assert kinds == {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu", "relu2": "relu2"}
    assert set(kinds.values()) <= set(GATED_ACTIVATIONS)


def test_the_mlps_route_through_the_kernel_and_stay_equal(fresh_registry, inline_plugin):
    config, model = _model()
    want = _static_run(model)  # the torch path (no prepare_model yet)
    stub = inline_plugin(StubActivation(), name="stub")
    assert _static_run(model) and stub.calls == []  # registered but not prepared: torch runs
    prepare_model(model, max_tokens=16)
    (request, choice), = model.mlp_kernels.items()
    assert choice.name == "stub.gated_activation" and "stub.gated_activation" not in choice.declined
    assert request == GatedActivationRequest(device=torch.device("cpu"), dtype=torch.float64, activation="silu",
                                             intermediate=config.intermediate_size)
    assert len(stub.requests) == 1  # one request for the whole model: chosen once, not per layer
    got = _static_run(model)
    assert len(stub.calls) == config.num_layers * len(got)  # every layer, prefill and every decode step
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # the stub runs the torch path's ops on the same halves
    release_model(model)
    assert "mlp_kernels" not in model.__dict__
    stub.calls.clear()
    _static_run(model)
    assert stub.calls == []  # released: the torch path again


def test_without_an_accepting_record_the_torch_path_runs(fresh_registry, inline_plugin):
    stub = inline_plugin(StubActivation(accepts=lambda request: False), name="stub")
    _, model = _model()
    want = _static_run(model)
    prepare_model(model, max_tokens=16)
    (choice,) = model.mlp_kernels.values()
    assert choice.name == TORCH and choice.declined[-1] == "stub.gated_activation"
    assert all(m.gated_activation_kernel is None for m in model.modules() if isinstance(m, TPGatedMLP))
    got = _static_run(model)
    assert stub.calls == [] and all(torch.equal(a, b) for a, b in zip(want, got))


class _TwoWidths(nn.Module):
    """Two gated MLPs of different widths (a dense MLP and a MoE's shared expert, say)."""

    def __init__(self, act="silu"):
        super().__init__()
        group = Parallel.single().groups["tp"]
        self.narrow = TPGatedMLP(8, 16, group, act, dtype=torch.float64)
        self.wide = TPGatedMLP(8, 48, group, act, dtype=torch.float64)
        self.wide_too = TPGatedMLP(8, 48, group, act, dtype=torch.float64)
        for p in self.parameters():
            nn.init.normal_(p, generator=torch.Generator().manual_seed(3))


def test_each_width_is_asked_once_and_gets_its_own_kernel(fresh_registry, inline_plugin):
    stub = inline_plugin(StubActivation(accepts=lambda request: request.intermediate == 48), name="stub")
    model = _TwoWidths()
    x = torch.randn(5, 8, dtype=torch.float64)
    want = [model.narrow(x), model.wide(x)]
    prepare_model(model, max_tokens=8)
    assert [r.intermediate for r in stub.requests] == [16, 48]  # module order, the twin not asked again
    assert {r.intermediate: c.name for r, c in model.mlp_kernels.items()} == {16: TORCH, 48: "stub.gated_activation"}
    assert model.narrow.gated_activation_kernel is None
    assert model.wide.gated_activation_kernel is model.wide_too.gated_activation_kernel is not None
    got = [model.narrow(x), model.wide(x)]
    assert stub.calls == [48] and all(torch.equal(a, b) for a, b in zip(want, got))
    line = describe(model)
    assert "(silu, width 16): core.torch (" in line and "stub.gated_activation declined)" in line
    assert "(silu, width 48): stub.gated_activation" in line and "agreed across the TP group" in line


def test_the_request_names_the_activation(fresh_registry, inline_plugin):
    stub = inline_plugin(StubActivation(accepts=lambda request: False), name="stub")
    prepare_model(_TwoWidths("gelu_pytorch_tanh"), max_tokens=8)
    assert {r.activation for r in stub.requests} == {"gelu_tanh"}


@pytest.mark.parametrize("targets", [("gate_proj", "up_proj", "down_proj"), ("down_proj",)], ids=["gate_up_deltas", "down_only"])
def test_the_lora_mlp_adds_its_deltas_before_the_kernel(fresh_registry, inline_plugin, targets):
    from layer_boundary_models.lora_layers import LoraGatedMLP, random_lora_spec

    stub = inline_plugin(StubActivation(), name="stub")
    group = Parallel.single().groups["tp"]
    mlp = LoraGatedMLP(8, 16, group, "silu", random_lora_spec(2, targets), dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        mlp.gate_up.normal_(generator=gen)
        mlp.down.weight.normal_(generator=gen)
    mlp.down.shard_addend = None  # the down delta is the row-parallel layer's, not this test's
    for name in ("lora_gate", "lora_up"):  # a delta per row that needs no published rows
        if getattr(mlp, name) is not None:
            delta = nn.Linear(8, 16, bias=False, dtype=torch.float64)
            nn.init.normal_(delta.weight, generator=gen)
            setattr(mlp, name, delta)
    x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
    with torch.inference_mode():
        want = mlp(x)
        prepare_model(mlp, max_tokens=8)
        assert mlp.gated_activation_kernel is not None
        got = mlp(x)
    assert stub.calls == [16] and torch.equal(want, got)


def _agreement(parallel):
    _, model = _model(parallel=parallel)
    prepare_model(model, max_tokens=16)
    return [c.name for c in model.mlp_kernels.values()]


def test_the_choice_is_agreed_across_the_tp_group(fresh_registry, inline_plugin):
    """A kernel only rank 1 accepts runs on no rank (its TP peer declined); one both accept runs on both."""
    import threading

    ranks = {}

    def run(parallel):
        ranks[threading.get_ident()] = parallel.rank
        return _agreement(parallel)

    inline_plugin(StubActivation(lambda request: ranks.get(threading.get_ident()) == 1, prefix="rank_one"), name="rank_one")
    inline_plugin(StubActivation(lambda request: True, prefix="zz_everyone"), name="everyone")
    assert run_threaded(run, Topology(tp=2)) == [["zz_everyone.gated_activation"]] * 2


def test_a_record_failing_on_one_rank_raises_on_every_rank_instead_of_hanging(fresh_registry, inline_plugin):
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

    inline_plugin(StubActivation(accepts, prefix="flaky"), name="flaky")
    rank0, rank1 = run_threaded(run, Topology(tp=2))
    assert "flaky.gated_activation" in rank1 and "rank 1's library is broken" in rank1
    assert "failed at prepare_model on another rank" in rank0


def test_plan_names_the_chain_and_the_choice(fresh_registry, inline_plugin, capsys):
    from layer_boundary.cli.main import main

    inline_plugin(StubActivation(), name="stub")
    config, model = _model(dtype=torch.float32)
    line = describe(model)
    assert f"(silu, width {config.intermediate_size}): stub.gated_activation" in line
    assert "stub.gated_activation > core.torch" in line and "this rank's answer" in line
    assert main(["plan", "--model", "qwen3", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"mlp kernels: gated activation (silu, width {config.intermediate_size // 2}) chosen on the device at prepare_model" in out
    assert "stub.gated_activation > core.torch" in out


@torch.inference_mode()
def test_the_kernel_traces_whole_under_torch_compile(fresh_registry, inline_plugin):
    reset_compiler()
    inline_plugin(StubActivation(compute=via_sigmoid, record=False), name="stub")
    config, model = _model()
    graph = compiled_decode_graph(model, config)
    # the graph holds the stub's activation (sigmoid; the torch path's silu has none), once per layer
    sigmoids = call_nodes(graph, lambda target: target is torch.sigmoid)
    assert len(sigmoids) == config.num_layers
