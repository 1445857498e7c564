"""Every reference model through the boundaries under `torch.compile(fullgraph=True)`: zero graph
breaks, a bounded number of graphs (prefill, the first decode, one decode with dynamic sizes),
and the eager logits (bit for bit where the compiled region runs the same kernels; the sparse
MoEs switch to dense dispatch inside a compiled region, so theirs agree to rounding). At TP=1,
2 and 4 (gloo, attention DP, the reduction policies), on the plugins' paths (mhc, the tbo
branch, LoRA's per-row adapters, two-batch overlap's microbatch forwards, a context-parallel
prefill), and through Inductor in float32.

Graph-break counts: `pytest tests/models/test_compile.py -q -rA` (each case asserts 0)."""

import functools

import attrs
import pytest

from layer_boundary.testing import requires_plugins
import torch

from layer_boundary import Parallel, Topology
from layer_boundary_models import family, model_config
from layer_boundary.cli.runner import RunJob, make_requests
from compiled_eager import compiled_vs_eager

#: the smallest configs that still reach every kind of layer of each family
SMALL = {
    "qwen3": {"num_hidden_layers": 2},
    "qwen3_moe": {"num_hidden_layers": 2, "mlp_only_layers": [1]},
    "gemma": {"num_hidden_layers": 2},
    "gemma2": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "nemotron_h": {"hybrid_override_pattern": "M-E*"},
    # mHC's Sinkhorn loop unrolls in the graph: a few iterations trace the same ops as twenty
    "deepseek_v4": {"num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2, "mlp_layer_types": ["moe"] * 2, "hc_sinkhorn_iters": 3},
    "longcat_flash": {"num_layers": 1},
    "olmo2": {"num_hidden_layers": 2},
    "gpt_neox": {"num_hidden_layers": 2},
    "cohere": {"num_hidden_layers": 2},
}
#: families whose eager MoE gathers each expert's rows (the compiled region runs them dense)
DENSE_WHEN_COMPILED = {"nemotron_h", "deepseek_v4", "longcat_flash"}
#: prefill, the first decode (a new mode and row count), one recompile with sizes made dynamic
MAX_GRAPHS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile-weights"))


@functools.lru_cache(maxsize=None)
def small_job(model: str, weights_dir: str, batch: int = 4, steps: int = 3, layers: int = 0) -> RunJob:
    """The model's SMALL config (with `layers` decoder layers, when given), random float64 weights."""
    config = model_config(model, {**dict(model_config(model).hf), **SMALL[model], **({"num_hidden_layers": layers} if layers else {})})
    path = f"{weights_dir}/{model}-{layers}.pt"
    torch.save(family(model).random_weights(config, torch.float64, seed=7), path)
    prompts, decode = make_requests(config.vocab_size, batch, 5, steps, seed=3)
    return RunJob(
        model=model, hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype="float64",
        weights=path, prompts=prompts, decode_tokens=decode,
    )


def check(results, model, *, bitwise=None):
    bitwise = model not in DENSE_WHEN_COMPILED if bitwise is None else bitwise
    for r in results:
        assert r["graph_breaks"] == 0, r
        assert 1 <= r["graphs"] <= MAX_GRAPHS, r
        if bitwise:
            assert r["equal"], r
        else:
            assert r["max_diff"] < 1e-10, r
    print(f"{model}: graph breaks {[r['graph_breaks'] for r in results]}, graphs {[r['graphs'] for r in results]}")


#: the models that need a plugin (deepseek_v4's mHC residual, longcat_flash's prepared branch)
NEEDS = {"deepseek_v4": requires_plugins("mhc"), "longcat_flash": requires_plugins("tbo")}


def _model_param(model, *rest, id=None):
    return pytest.param(model, *rest, marks=[NEEDS[model]] if model in NEEDS else [], id=id)


@pytest.mark.parametrize("model", [_model_param(m, id=m) for m in sorted(SMALL)])
def test_tp1_prefill_and_decode_compile_whole(weights_dir, model):
    check([compiled_vs_eager(Parallel.single(), small_job(model, weights_dir))], model)


def test_aot_eager_equals_eager_bitwise(weights_dir):
    """AOT autograd's functionalized graph, run eagerly: the same bits in float64."""
    r = compiled_vs_eager(Parallel.single(), small_job("qwen3_moe", weights_dir), backend="aot_eager")
    check([r], "qwen3_moe", bitwise=True)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "model, topology, reduction",
    [
        _model_param("qwen3_moe", Topology(tp=2, attn_dp=2), "rs+rsv", id="moe-dp2-rs+rsv"),
        _model_param("qwen3_moe", Topology(tp=2, attn_dp=2), "rs", id="moe-dp2-rs"),
        _model_param("qwen3_moe", Topology(tp=2), "rsv", id="moe-tp2-rsv"),
        _model_param("gemma", Topology(tp=2), "ar", id="gemma-tp2"),
        # the sandwich norms: a post-norm after a completed sum (attention's, at the FFN input)
        _model_param("gemma2", Topology(tp=2), "ar", id="gemma2-tp2"),
        _model_param("gemma3", Topology(tp=2, attn_dp=2), "rs+rsv", id="gemma3-dp2"),
        _model_param("nemotron_h", Topology(tp=2), "ar", id="nemotron_h-tp2"),
        _model_param("deepseek_v4", Topology(tp=2), "ar", id="deepseek_v4-tp2"),
        _model_param("longcat_flash", Topology(tp=2), "ar", id="longcat-tp2"),
        # the q/k statistic's all_reduce inside the attention's compute
        _model_param("olmo2", Topology(tp=2), "ar", id="olmo2-tp2"),
        # the parallel residual: the attention's partial carried to the MLP's exit and joined with
        # its partial (one sum deferred to the next input; under attention DP, in the DP slot)
        _model_param("gpt_neox", Topology(tp=2), "ar", id="gpt_neox-tp2"),
        _model_param("cohere", Topology(tp=2, attn_dp=2), "rs+rsv", id="cohere-dp2"),
    ],
)
def test_tp2_gloo_compiles_whole(gloo_world, weights_dir, model, topology, reduction):
    job = attrs.evolve(small_job(model, weights_dir), topology=topology, reduction=reduction)
    check(gloo_world(2).run(compiled_vs_eager, topology, job, timeout=600), model)


@pytest.mark.gloo
def test_tp2_aot_eager_equals_eager_bitwise(gloo_world, weights_dir):
    """qwen3 at TP=2: functional collectives in AOT autograd's graph, the same bits as eager."""
    topology = Topology(tp=2)
    job = attrs.evolve(small_job("qwen3", weights_dir), topology=topology)
    check(gloo_world(2).run(compiled_vs_eager, topology, job, backend="aot_eager", timeout=600), "qwen3", bitwise=True)


# TP=4 ---------------------------------------------------------------------------------------------
# one decoder layer each: the layer kinds are the ones the TP=2 cases already reach, and four
# ranks compiling on two cores are the slowest cases of the suite


@pytest.mark.gloo
@pytest.mark.parametrize(
    "model, reduction, backend",
    [("qwen3_moe", "rs+rsv", "eager"), ("qwen3", "rs", "aot_eager")],
    ids=["moe-dp2xtp2-rs+rsv", "qwen3-dp2xtp2-rs-aot_eager"],
)
def test_tp4_gloo_with_attention_dp_compiles_whole(gloo_world, weights_dir, model, reduction, backend):
    topology = Topology(tp=4, attn_dp=2)
    job = attrs.evolve(small_job(model, weights_dir, layers=1), topology=topology, reduction=reduction)
    check(gloo_world(4).run(compiled_vs_eager, topology, job, backend=backend, timeout=600), model, bitwise=True)


# the plugins' paths -------------------------------------------------------------------------------

#: two adapters and a base-only request in one batch (requests 0..3)
LORA = {"lora": 2, "lora_seed": 5, "lora_assignment": (0, 1, -1, 0)}


@requires_plugins("lora")
def test_lora_rows_compile_whole_and_aot_eager_equals_eager_bitwise(weights_dir):
    """LoRA's row publication and per-row adapters inside the graph: every adapter on every row,
    each row keeping its own (as the MoEs' dense dispatch: a GEMM over every row may round apart
    from eager's over one adapter's rows, so to rounding; bit for bit on this CPU)."""
    job = attrs.evolve(small_job("qwen3", weights_dir), options=LORA)
    check([compiled_vs_eager(Parallel.single(), job, backend="aot_eager")], "qwen3", bitwise=False)


@requires_plugins("tbo")
def test_tbo_microbatch_forwards_compile_whole_and_aot_eager_equals_eager_bitwise(weights_dir):
    """Two-batch overlap traced through: the split, both microbatches' forwards (their own
    Forward and stream, interleaved at every stage) and the merge in one graph; the prefill cut
    falls inside a request."""
    job = attrs.evolve(small_job("qwen3_moe", weights_dir), options={"tbo": True})
    check([compiled_vs_eager(Parallel.single(), job, backend="aot_eager")], "qwen3_moe", bitwise=True)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "model, topology, reduction, options",
    [
        pytest.param("qwen3", Topology(tp=2, attn_dp=2), "ar", LORA, marks=requires_plugins("lora"), id="lora-dp2"),
        pytest.param("qwen3_moe", Topology(tp=2, attn_dp=2), "rs+rsv", {"tbo": True}, marks=requires_plugins("tbo"), id="tbo-dp2"),
        pytest.param("qwen3", Topology(tp=2, attn_cp=2), "ar", {"cp_order": "zigzag"}, marks=requires_plugins("cp"), id="cp2-zigzag"),
    ],
)
def test_plugin_paths_at_tp2_gloo_compile_whole(gloo_world, weights_dir, model, topology, reduction, options):
    """LoRA's ids gathered over attention DP, TBO's split per DP rank, and a context-parallel
    prefill (each CP rank its share of the rows; decode ordinary), all in the graph."""
    job = attrs.evolve(small_job(model, weights_dir, layers=1), topology=topology, reduction=reduction, options=options)
    check(gloo_world(2).run(compiled_vs_eager, topology, job, timeout=600), model, bitwise="lora" not in options)


# Inductor -----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def inductor_unavailable() -> str:
    """Why Inductor cannot build code here ("" when it can): it compiles C++ for the CPU."""
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: x.sin() + 1, backend="inductor", fullgraph=True)(torch.ones(3))
    except Exception as error:  # a missing or broken C++ toolchain
        return f"Inductor cannot build CPU kernels on this machine ({type(error).__name__}: {str(error)[:160]})"
    finally:
        torch._dynamo.reset()
    return ""


#: float32 logits of the small qwen3 are O(1): Inductor's fused kernels reorder the sums
FLOAT32_TOLERANCE = 1e-4


def test_inductor_agrees_within_the_float32_tolerance(weights_dir):
    if inductor_unavailable():
        pytest.skip(inductor_unavailable())
    job = attrs.evolve(small_job("qwen3", weights_dir, layers=1), dtype="float32")
    r = compiled_vs_eager(Parallel.single(), job, backend="inductor")
    assert r["graph_breaks"] == 0 and 1 <= r["graphs"] <= MAX_GRAPHS, r
    assert r["max_diff"] < FLOAT32_TOLERANCE, r
    print(f"qwen3 float32, inductor: graphs {r['graphs']}, max |compiled - eager| {r['max_diff']:.1e}")
