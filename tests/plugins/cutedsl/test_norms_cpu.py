"""The norms kernels of post-norm, sandwich and LayerNorm layers on a CPU: every variant (local and
one-shot) compiles for sm_90a and lints; their fast launch packs what the DSL marshals; the
float64 references match the core's torch completion; the "cutedsl.local_norms" record takes and
declines what it should; and models (gemma3's sandwich, olmo2's post-norm, gpt_neox's LayerNorm)
run with the references: over one rank each completion is one local call, over two each is one
one-shot launch (the last layer's sum completes in its MLP, then one local call at the final
norm), matching the plugin off.
"""

import ctypes
import importlib.util

import pytest
import torch

from layer_boundary import GemmaRMSNorm, LayerNorm, Parallel, RMSNorm, Topology
from layer_boundary.plugin import AddNormKernel, NormSpec, PostNormRequest, hookimpl
from layer_boundary.testing.contract import check_add_norm_kernel
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_models import family, model_config
from layer_boundary_cutedsl.kernels.allreduce_layout import (
    NORMS_ENTRY_KINDS, NORMS_N_ADDRESSES, AllReduceNormsVariant, all_allreduce_norms_variants,
)
from layer_boundary_cutedsl.kernels.norms import ENTRY_KINDS, N_ADDRESSES, NormsShape, NormsVariant, all_norms_variants
from layer_boundary_cutedsl.kernels.reference import add_norms_reference
from layer_boundary_cutedsl.local_add_norm import NormsFactory, norms_factory
from layer_boundary_cutedsl.testing import reference_kernels, reference_oneshot

from .decoder_driver import max_rel_diff, requests, run_decoder

needs_cutlass = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                   reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

# ------------------------------------------------------------------------------ compile and lint


def _ptx(variant, tmp_path):
    from layer_boundary_cutedsl.kernels.compiler import compile_variant
    from .ptx_lint import lint

    compiled = compile_variant(variant, "sm_90a", keep_ptx_dir=str(tmp_path))
    assert compiled.has_gpu_module and len(compiled.kernel_info) == 1
    ptx = compiled.__ptx__
    assert lint(ptx, variant.tiling().cta_threads) == [] and ".local" not in ptx
    return ptx


def _weights(shape) -> int:
    """The [H] weight rows a shape reads: gamma (not for an identity read), beta, post_gamma."""
    return (shape.norm != "none") + shape.bias + shape.post


def _reductions(shape) -> int:
    return shape.post + {"rms": 1, "layer": 2, "none": 0}[shape.norm]


@needs_cutlass
@pytest.mark.parametrize("variant", all_norms_variants(), ids=lambda v: v.name)
def test_local_norms_variant_compiles_and_lints(variant, tmp_path):
    """16-byte loads of x, the residual and each weight row; stores of the new residual and (not
    for an identity read) the norm; a barrier per block reduction of a row spread over warps."""
    ptx = _ptx(variant, tmp_path)
    vpt, shape = variant.tiling().vpt, variant.shape
    assert ptx.count("ld.global.v4.b32") == (2 + _weights(shape)) * vpt
    assert ptx.count("st.global.v4.b32") == (1 + (shape.norm != "none")) * vpt
    if variant.tiling().warps > 1:
        assert ptx.count("bar.sync") + ptx.count("barrier.sync") == _reductions(shape)


@needs_cutlass
@pytest.mark.parametrize("variant", all_allreduce_norms_variants(), ids=lambda v: v.name)
def test_allreduce_norms_variant_compiles_and_lints(variant, tmp_path):
    """The one-shot protocol of the add + RMSNorm kernel (sys-scope flag release, acquire spin,
    L1-bypassing peer loads, the bounded spin that traps, the epoch handed on) around the norms."""
    ptx = _ptx(variant, tmp_path)
    vpt, shape = variant.tiling().vpt, variant.shape
    assert ptx.count("ld.global.cg.v4.b32") == variant.world * vpt
    assert ptx.count("ld.global.v4.b32") == (2 + _weights(shape)) * vpt  # the partial, the residual, the weights
    assert ptx.count("st.global.v4.b32") == (2 + (shape.norm != "none")) * vpt  # the staged row, the residual, the norm
    assert ptx.count("fence.acq_rel.sys") >= 1 and "st.relaxed.sys.global.b64" in ptx and "ld.acquire.sys.global.b64" in ptx
    assert "trap;" in ptx and "atom.global.acq_rel.add.u64" in ptx


def test_shapes_refuse_what_no_kernel_computes():
    with pytest.raises(ValueError, match="plain add"):
        NormsShape("none")
    with pytest.raises(ValueError, match="LayerNorm read"):
        NormsShape("rms", bias=True)
    with pytest.raises(ValueError, match="add \\+ RMSNorm"):
        AllReduceNormsVariant.of(torch.bfloat16, 4096, 2, NormsShape("rms"))
    assert len({v.name for v in all_norms_variants()}) == len(all_norms_variants())


@needs_cutlass
@pytest.mark.parametrize("variant, kinds, n_addresses", [
    (NormsVariant(torch.bfloat16, 4096, NormsShape("layer", bias=True)), ENTRY_KINDS, N_ADDRESSES),
    (AllReduceNormsVariant.of(torch.bfloat16, 4096, 4, NormsShape("rms", 1.0, post=True, post_offset=1.0)), NORMS_ENTRY_KINDS,
     NORMS_N_ADDRESSES),
], ids=["local", "oneshot"])
def test_fast_launch_packs_what_the_dsl_marshals(variant, kinds, n_addresses):
    from layer_boundary_cutedsl.kernels._launch import FastCall
    from layer_boundary_cutedsl.kernels.compiler import compile_variant

    from .test_compile_cpu import recording_executor

    compiled = compile_variant(variant, "sm_90a")
    FakeExecutor, seen, result = recording_executor(len(kinds) + 1)
    launcher = FastCall(FakeExecutor, kinds)
    scalars = {"i32": 4097, "f32": 1e-5, "stream": 0xABC0}
    probe = tuple(0x7F0000001000 + 16 * i if kind == "i64" else scalars[kind] for i, kind in enumerate(kinds))
    assert launcher.matches(compiled.execution_args, probe)
    launcher(*probe)
    packed = seen[-1]
    assert [ctypes.c_int64.from_address(p).value for p in packed[:n_addresses]] == list(probe[:n_addresses])
    floats = [ctypes.c_float.from_address(packed[i]).value for i, kind in enumerate(kinds) if kind == "f32"]
    assert floats == pytest.approx([1e-5, 1e-5]) and packed[-1] == ctypes.addressof(result)


# ------------------------------------------------------------------------------ references and factories

H = 64


def _norm(cls, seed, **kw):
    norm = cls(H, dtype=torch.float64, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_((0.0 if getattr(norm, "offset", 0.0) else 1.0) + 0.2 * torch.randn(H, generator=g, dtype=torch.float64))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.2 * torch.randn(H, generator=g, dtype=torch.float64))
    return norm


CASES = {
    "sandwich": (NormsShape("rms", 1.0, post=True, post_offset=1.0), GemmaRMSNorm, GemmaRMSNorm),
    "post_norm": (NormsShape("none", post=True), RMSNorm, None),
    "layer": (NormsShape("layer", bias=True), None, LayerNorm),
    "layer_no_bias": (NormsShape("layer"), None, LayerNorm),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_reference_is_the_core_torch_completion_in_float64(case):
    from layer_boundary._residual.add_norm import NORM_READ
    from layer_boundary._residual.post_norm import PostNormRead

    shape, post_cls, read_cls = CASES[case]
    kw = dict(compute_dtype=torch.float64) if read_cls is not LayerNorm else dict(compute_dtype=None, bias=shape.bias)
    read = _norm(read_cls, 1, **kw) if read_cls is not None else None
    post = _norm(post_cls, 2, compute_dtype=torch.float64) if post_cls is not None else None
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(7, H, generator=g, dtype=torch.float64), torch.randn(7, H, generator=g, dtype=torch.float64)
    got = add_norms_reference(x, r, None if read is None else read.weight, getattr(read, "bias", None),
                              None if post is None else post.weight, getattr(read, "eps", 0.0), getattr(post, "eps", 0.0), shape)
    if post is not None:
        from layer_boundary_models.residual_reads import Unnormed

        want = PostNormRead(post, NORM_READ, read if read is not None else Unnormed(H)).torch_read(x, r)
    else:
        want = read.add_forward(x, r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def _post_request(**changes):
    facts = dict(device=torch.device("cpu"), dtype=torch.bfloat16, contribution_dtype=torch.bfloat16, hidden_size=4096,
                 post=NormSpec(norm_kind="gemma_rms", weight_dtype=torch.bfloat16, offset=1.0, eps=1e-6, compute_dtype=torch.float32),
                 norm=NormSpec(norm_kind="gemma_rms", weight_dtype=torch.bfloat16, offset=1.0, eps=1e-6, compute_dtype=torch.float32))
    facts.update(changes)
    return PostNormRequest(**facts)


@pytest.mark.parametrize("changes, why", [
    ({}, "a cpu device"),
    ({"dtype": torch.float32, "contribution_dtype": torch.float32}, "differ in dtype"),
    ({"hidden_size": 4100}, "width 4100"),
    ({"post": NormSpec(norm_kind="gemma_rms", weight_dtype=torch.bfloat16, offset=1.0, eps=1e-6, compute_dtype=torch.float64)},
     "statistics in torch.float64"),
])
def test_the_local_norms_factory_declines_what_the_kernel_cannot_run(changes, why):
    request = _post_request(**changes)
    assert why in norms_factory.reason(request, (request.post, request.norm))
    assert norms_factory.post_norm_factory(request) is None
    layer_post = _post_request(device=torch.device("cpu"), post=NormSpec(norm_kind="layer", weight_dtype=torch.bfloat16, eps=1e-5,
                                                                           compute_dtype=torch.float32))
    assert NormsFactory(reference_kernels()).post_norm_factory(layer_post) is None  # the kernels' post-norm is an RMSNorm


def test_the_local_norms_record_keeps_the_add_norm_contract():
    """Its LayerNorm add + norm and its post-norm + add + norm (over the float64 references) match
    the core's torch completion, write nothing they read, never raise (the contract suite)."""
    report = check_add_norm_kernel("cutedsl.local_norms")
    assert report.stats["accepted"] >= 8 and report.stats["launches"] > 0


# ------------------------------------------------------------------------------ models with the references

#: 3 layers; gpt_neox sequential (pre-norm with LayerNorm reads); float64
MODELS = {
    "gemma3": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "olmo2": {"num_hidden_layers": 3},
    "gpt_neox": {"num_hidden_layers": 3, "use_parallel_residual": False},
}
LAYERS = 3
DTYPE = torch.float64
TOL = 1e-5  # the core's RMSNorms compute their statistic in float32, the references in float64


class LocalNorms:
    """"cutedsl.local_norms" over the float64 references, ranked first: every local completion of
    the model goes through it (and is counted in `calls`)."""

    def __init__(self, calls):
        self.factory = NormsFactory(reference_kernels(calls))

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        yield AddNormKernel(name="refnorms.local", factory=self.factory, post_norm_factory=self.factory.post_norm_factory,
                            priority=900, norm_kinds=("rms", "gemma_rms", "layer"), description="the norms references")


def _model_run(parallel, name, state, prompts, decode, plugin):
    calls = []
    cutedsl = {"kernels": reference_kernels(calls, oneshot=reference_oneshot(calls)), "terminal_finalize": False} if plugin else None
    hf = dict(family(name).preset(), **MODELS[name])
    logits, service, _ = run_decoder(parallel, hf, state, prompts, decode, dtype=DTYPE, cutedsl=cutedsl, model_name=name)
    if service is not None:
        assert service.usable and (service.oneshot is not None) == (parallel.topology.tp > 1), service.oneshot_reason
        service.release()
    return logits, calls


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request):
    name = request.param
    config = model_config(name, dict(family(name).preset(), **MODELS[name]))
    state = family(name).random_weights(config, DTYPE, seed=5)
    prompts, decode = requests(config, batch=3, prompt=5, steps=2)
    off, _ = _model_run(Parallel.single(), name, state, prompts, decode, False)
    return name, state, prompts, decode, off


@pytest.mark.parametrize("tp", [1, 2])
def test_each_completion_is_one_fused_call(model_case, tp, inline_plugin):
    name, state, prompts, decode, off = model_case
    local = []
    inline_plugin(LocalNorms(local), name="refnorms")
    if tp == 1:
        results = [_model_run(Parallel.single(), name, state, prompts, decode, True)]
    else:
        results = run_threaded(lambda p: _model_run(p, name, state, prompts, decode, True), Topology(tp=tp), timeout=120)
    steps = 1 + len(decode)
    for logits, calls in results:
        assert max_rel_diff(logits, off) < TOL
        launched = [c[0] for c in calls if not c[0].startswith(("prepare", "oneshot_prepare"))]
        if tp == 1:  # two completions a layer, each one local call (the last at the final norm)
            assert launched == []
        else:  # each completion one one-shot launch but the last layer's MLP sum, completed in the MLP
            assert launched == ["oneshot_all_reduce_add_norms"] * ((2 * LAYERS - 1) * steps)
    local_calls = [c for c in local if c[0] == "add_norms"]
    assert len(local_calls) == (2 * LAYERS if tp == 1 else 1) * steps * tp


def test_the_oneshot_norms_check_runs_dry_on_cpu_ranks():
    """norms_checks.check_oneshot_norms (what the GPU test asserts) over the reference protocol:
    every shape within the bar of float64 and of the unfused path, the ranks bit-identical."""
    from .norms_checks import SHAPES, check_oneshot_norms

    rows = [r for rank_rows in run_threaded(lambda p: check_oneshot_norms(p, 64, (1, 5), dry=True), Topology(tp=2), timeout=120)
            for r in rank_rows]
    assert len(rows) == 2 * len(SHAPES) * 2 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in by_case.values())


def test_the_ops_of_a_compiled_graph_give_the_kernels_output_shapes():
    """Inside torch.compile each norms launch is one custom op; their fake implementations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from layer_boundary_cutedsl import graph_ops
    from layer_boundary_cutedsl.local_add_norm import graph_add_norms

    with FakeTensorMode():
        x, w = torch.empty(5, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
        for shape in (NormsShape("rms", 1.0, post=True, post_offset=1.0), NormsShape("layer", bias=True), NormsShape("none", post=True)):
            normed, residual = graph_add_norms(x, x, w, w, w, 1e-5, 1e-6, shape)
            assert normed.shape == residual.shape == (5, 64) and residual.dtype == torch.bfloat16
            normed, residual = graph_ops.graph_oneshot_add_norms(x, x, w, w, w, 1e-5, 1e-6, shape, "key")
            assert normed.shape == residual.shape == (5, 64)
            assert (normed is residual) == (shape.norm == "none")  # an identity read: the new residual twice
