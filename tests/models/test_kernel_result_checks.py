"""The reference models' plugin kernels (rope, q/k norm + rope, decode attention, gated
activation) are installed with their returns held to the request, and a fusion provider's wrong
return is caught at the candidate in a whole model run: each fails naming the record, its plugin
and LAYER_BOUNDARY_DISABLE_PLUGINS=<plugin>, not inside the next GEMM or at the parity check.
The kernels are torch stubs registered inline."""

import pytest
import torch
from torch import nn

from layer_boundary import FusedMlpInput, FusionError, Parallel, Topology, prepare_model
from layer_boundary_models import build_model, family, model_config
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary.plugin import (
    DecodeAttentionKernel,
    FusionProvider,
    GatedActivationKernel,
    RopeKernel,
    StateDictSource,
    add_rms_norm,
    hookimpl,
)
from layer_boundary.testing.threaded import run_threaded

HINT = "set LAYER_BOUNDARY_DISABLE_PLUGINS=vendor to run without it"


def _model():
    config = model_config("qwen3")
    model = build_model(config, Parallel.single(), dtype=torch.float64)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, torch.float64, seed=5)))
    return model.eval()


@torch.inference_mode()
def _static_run(model):
    config, parallel = model.config, Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 3, 5, 2, seed=2)
    cache = model.new_static_cache(len(prompts), 16)
    static_prefill(model, parallel, cache, prompts, "cpu")
    positions = torch.tensor([len(p) for p in prompts])
    for s, tokens in enumerate(decode):
        static_decode_step(model, parallel, cache, torch.tensor(tokens), None, positions + s)


class Vendor:
    """One kernel of each kind; `spoil` picks which returns a wrong tensor."""

    def __init__(self, spoil: str):
        def activation(request):
            d = request.intermediate

            def kernel(gate_up):
                out = nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]
                return out[:, :-1] if spoil == "activation" else out

            return kernel

        def rope(request):
            def kernel(q, k, positions):  # no rotation: only the shapes matter here
                return (q[:1], k) if spoil == "rope" else (q.clone(), k.clone())

            return kernel

        def decode(request):
            def kernel(q, k_cache, v_cache, slots, positions):
                out = torch.zeros_like(q)
                return out.float() if spoil == "decode" else out

            return kernel

        self.records = {
            "gated": GatedActivationKernel(name="vendor.act", factory=activation, priority=100),
            "rope": RopeKernel(name="vendor.rope", factory=rope, priority=100),
            "decode": DecodeAttentionKernel(name="vendor.decode", factory=decode, priority=100),
        }

    @hookimpl
    def layer_boundary_gated_activation_kernels(self):
        yield self.records["gated"]

    @hookimpl
    def layer_boundary_rope_kernels(self):
        yield self.records["rope"]

    @hookimpl
    def layer_boundary_decode_attention_kernels(self):
        yield self.records["decode"]


WIDTH = model_config("qwen3").intermediate_size


@pytest.mark.parametrize("spoil, expected", [
    ("activation", r"gated-activation kernel record 'vendor.act' of plugin 'vendor' \(distribution test:vendor\) returned a wrong "
                   rf"activation: size {WIDTH - 1} in dimension 1 where {WIDTH} was asked \(got a tensor \(15, {WIDTH - 1}\)"),
    ("rope", r"rope kernel record 'vendor.rope' of plugin 'vendor' .* returned a wrong query output: 1 row where 15 were asked"),
    ("decode", r"decode-attention kernel record 'vendor.decode' of plugin 'vendor' .* returned a wrong attention output: float32 "
               r"where float64 was asked"),
])
def test_a_model_kernel_returning_the_wrong_tensor_fails_at_the_kernel(fresh_registry, inline_plugin, spoil, expected):
    inline_plugin(Vendor(spoil), name="vendor")
    model = _model()
    prepare_model(model, max_tokens=16)
    with pytest.raises(FusionError, match=expected) as info:
        _static_run(model)
    assert str(info.value).endswith(HINT)


def test_right_model_kernels_pass_their_checks(fresh_registry, inline_plugin):
    inline_plugin(Vendor(spoil=""), name="vendor")
    model = _model()
    prepare_model(model, max_tokens=16)
    assert model.mlp_kernels and all(c.name == "vendor.act" and c.plugin == "vendor" for c in model.mlp_kernels.values())
    _static_run(model)  # zeros for attention: numerically wrong, but every return is what was asked


class OneRowResidual:
    """A fusion provider whose residual is one row: it would broadcast into every later sum."""

    def attention_input(self, stage):
        norm = stage.norm

        def run(owed, residual, fwd):
            inp, new_residual = add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)
            return inp, new_residual[:1]

        return (FusedMlpInput(run=run, name="vendor.ar_add_rmsnorm"),)

    ffn_input = attention_input

    @hookimpl
    def layer_boundary_fusion_providers(self):
        yield FusionProvider(name="vendor.fused", factory=lambda stage: self, priority=10)


def test_a_broadcasting_residual_fails_a_model_run_at_the_candidate(fresh_registry, inline_plugin, tmp_path):
    inline_plugin(OneRowResidual(), name="vendor")
    config = model_config("qwen3")
    weights = tmp_path / "w.pt"
    torch.save(family("qwen3").random_weights(config, torch.float64, 0), weights)
    prompts, decode = make_requests(config.vocab_size, 3, 5, 1, 0)
    job = RunJob(model="qwen3", hf_config=dict(config.hf), topology=Topology(tp=2), reduction="ar", dtype="float64",
                 weights=str(weights), prompts=prompts, decode_tokens=decode)
    with pytest.raises(FusionError, match=r"fusion candidate 'vendor.ar_add_rmsnorm' from record 'vendor.fused' of plugin "
                                          rf"'vendor' .* returned a wrong new residual: 1 row where {sum(map(len, prompts))} were asked") as info:
        run_threaded(run_rank, Topology(tp=2), job, timeout=60)
    assert str(info.value).endswith(HINT)
