"""OLMo-2 (post-norm), GPT-NeoX (LayerNorm with biases, partial rotary, parallel and sequential
residual) and Cohere (one LayerNorm feeding both branches, per-head q/k norms, logit scale)
against Hugging Face in float64, in the threaded world: TP 1, 2 and 4, attention DP 2, two
pipeline stages, sequence parallel, prefill and decode steps; the collectives each layer issues
(one sum a layer for the parallel residual, also under gloo); OLMo-2's q/k statistic across
attention TP; configs refused at parse."""

import functools

import attrs
import pytest
import torch

from layer_boundary import CollectiveCounter, CountingCollectives, Parallel, Topology
from layer_boundary.cli.plan_cmd import build_plan_report
from layer_boundary.plugin import ConfigError
from layer_boundary_models import family, model_config
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary_models.residual_norms import ProjectionQKNorm
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary.testing import requires_plugins
from layer_boundary.testing.threaded import run_threaded

from model_cases import TOLERANCE, rel_error

#: (family, changes to its preset): every residual shape and every optional feature
CASES = {
    "olmo2": ("olmo2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "cohere": ("cohere", {}),
    # the other settings of the optional features, at TP 2 only
    "olmo2-bias": ("olmo2", {"attention_bias": True}),
    "gpt_neox-no-attention-bias": ("gpt_neox", {"attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}}),
    "cohere-bias-no-qk-norm": ("cohere", {"use_qk_norm": False, "attention_bias": True, "tie_word_embeddings": False}),
}
TOPOLOGIES = {
    "tp1": (Topology(), "ar"),
    "tp2": (Topology(tp=2), "ar"),
    "tp4": (Topology(tp=4), "ar"),  # OLMo-2's and Cohere's 2 KV heads replicated over 4 ranks
    "dp2xtp2": (Topology(tp=4, attn_dp=2), "rs+rsv"),
    "tp2-pp2": (Topology(tp=2, pp=2), "ar"),
}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("residual-weights"))


@functools.lru_cache(maxsize=None)
def _case(case: str, weights_dir: str):
    """(job, Hugging Face logits per request) of a case, float64."""
    name, changes = CASES[case]
    raw = {**family(name).preset(), **changes}
    config = model_config(name, raw)
    state = family(name).random_weights(config, torch.float64, seed=7)
    path = f"{weights_dir}/{case}.pt"
    torch.save(state, path)
    prompts, decode = make_requests(config.vocab_size, 4, 6, 3, seed=3)
    ref = hf_logits(hf_from_state(raw, state, torch.float64), [torch.tensor(p) for p in prompts], decode)
    job = RunJob(model=name, hf_config=raw, topology=Topology(), reduction="ar", dtype="float64", weights=path, prompts=prompts,
                 decode_tokens=decode)
    return job, ref


@functools.lru_cache(maxsize=None)
def _run(case: str, topo: str, weights_dir: str, extras: tuple = (), **changes):
    """The case's run on the topology: RunJob `changes`, and `extras` as (key, value) pairs of
    per-forward facts (`RunJob.options`)."""
    job, _ = _case(case, weights_dir)
    topology, reduction = TOPOLOGIES[topo]
    job = attrs.evolve(job, **{"topology": topology, "reduction": reduction, "options": dict(extras), **changes})
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job)]
    return run_threaded(run_rank, topology, job, timeout=120)


def _tolerance(case: str, topo: str) -> float:
    """1e-10; OLMo-2 split over attention TP: the family's (Hugging Face's q/k statistic is an
    fp32 sum, which ranks add in another order)."""
    name = CASES[case][0]
    if topo == "tp1" or TOPOLOGIES[topo][0].attn_tp == 1:
        return TOLERANCE["float64"]
    return max(TOLERANCE["float64"], family(name).tolerances.get("float64", 0.0))


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
@pytest.mark.parametrize("case", ["olmo2", "gpt_neox", "gpt_neox-sequential", "cohere"])
def test_matches_hf_in_float64(weights_dir, case, topo):
    results = _run(case, topo, weights_dir)
    _, ref = _case(case, weights_dir)
    assert rel_error(results, ref) < _tolerance(case, topo)
    if TOPOLOGIES[topo][0].pp > 1:
        assert all(not r["logits"] for r in results if r["rank"] < 2)  # only the last stage reports


@pytest.mark.parametrize("case", ["olmo2-bias", "gpt_neox-no-attention-bias", "cohere-bias-no-qk-norm"])
def test_the_other_feature_settings_match_hf(weights_dir, case):
    _, ref = _case(case, weights_dir)
    assert rel_error(_run(case, "tp2", weights_dir), ref) < _tolerance(case, "tp2")


@pytest.mark.parametrize("case", ["gpt_neox", "cohere"])
def test_sequence_parallel_matches_hf(weights_dir, case):
    """The parallel residual's second branch reads on attention-TP slices before the gather."""
    _, ref = _case(case, weights_dir)
    results = _run(case, "tp4", weights_dir, sequence_parallel=True, reduction="rs+rsv")
    assert rel_error(results, ref) < TOLERANCE["float64"]
    assert results[0]["collectives"]["prefill"].get("reduce_scatterv@attn_tp")  # the prefill ran on slices


@requires_plugins("tbo")
@pytest.mark.parametrize("case", ["olmo2", "gpt_neox"])
def test_two_batch_overlap_runs_the_layers_as_operations(weights_dir, case):
    """The layers' `operations` (post-norm, parallel residual) under two-batch overlap, attention DP 2."""
    _, ref = _case(case, weights_dir)
    results = _run(case, "dp2xtp2", weights_dir, extras=(("tbo", True),))
    assert rel_error(results, ref) < _tolerance(case, "dp2xtp2")


def _as_reference(results) -> list:
    logits = {}
    for r in results:
        logits.update(r["logits"])
    return [logits[rid] for rid in sorted(logits)]


@pytest.mark.parametrize("case", ["olmo2", "gpt_neox", "cohere"])
def test_every_topology_matches_the_single_rank(weights_dir, case):
    single = _as_reference(_run(case, "tp1", weights_dir))
    for topo in ("tp2", "dp2xtp2", "tp2-pp2"):
        assert rel_error(_run(case, topo, weights_dir), single) < _tolerance(case, topo), topo


def test_a_dropped_bias_fails_the_check(weights_dir):
    """The comparison sees the biases: the reference without the MLP output biases differs."""
    job, ref = _case("gpt_neox", weights_dir)
    state = torch.load(job.weights)
    for key in [k for k in state if k.endswith("dense_4h_to_h.bias")]:
        state[key] = torch.zeros_like(state[key])
    unbiased = hf_logits(hf_from_state(job.hf_config, state, torch.float64), [torch.tensor(p) for p in job.prompts], job.decode_tokens)
    assert rel_error(_run("gpt_neox", "tp2", weights_dir), unbiased) > 1e-3


# --- what each layer issues ----------------------------------------------------------------------

#: decode-step collectives of the 4-layer presets: (TP 2, TP 4 with attention DP 2)
PER_STEP = {
    # the attention sum and the q/k statistic over attention TP; the MLP's sum over TP (deferred
    # with its post-norm to the next input, which completes sum, norm and add in one call)
    "olmo2": (
        {"all_reduce@attn_tp": 8, "all_reduce@tp": 4},
        {"all_reduce@attn_tp": 8, "all_gatherv@attn_dp": 4, "all_reduce@tp": 4},
    ),
    # the parallel residual: the attention's partial joins the MLP's, one sum a layer (deferred to the
    # next input); under attention DP it joins in its DP slot of the gathered rows, and the MLP's
    # reduce-scatter completes both
    "gpt_neox": (
        {"all_reduce@tp": 4},
        {"all_gatherv@attn_dp": 4, "reduce_scatterv@tp": 4, "all_gatherv@attn_tp": 4},
    ),
    "cohere": (
        {"all_reduce@tp": 4},
        {"all_gatherv@attn_dp": 4, "reduce_scatterv@tp": 4, "all_gatherv@attn_tp": 4},
    ),
    # the sequential residual: each stage's own sum, two a layer (under attention DP the attention's
    # completes as it gathers the MLP's input: one all_reduce@tp over the DP-gathered rows)
    "gpt_neox-sequential": (
        {"all_reduce@attn_tp": 4, "all_reduce@tp": 4},
        {"all_reduce@tp": 4, "reduce_scatterv@tp": 4, "all_gatherv@attn_tp": 4},
    ),
}


@pytest.mark.parametrize("case", list(PER_STEP))
def test_collectives_per_decode_step(weights_dir, case):
    tp2, dp2 = PER_STEP[case]
    assert _run(case, "tp2", weights_dir)[0]["collectives"]["decode1"] == tp2
    assert _run(case, "dp2xtp2", weights_dir)[0]["collectives"]["decode1"] == dp2


@pytest.mark.parametrize("case", ["gpt_neox", "cohere"])
def test_the_parallel_residual_issues_one_all_reduce_a_layer(weights_dir, case):
    """Where attention TP is TP, prefill and decode: one all_reduce@tp a layer on every rank
    (the sequential residual of the same model issues two)."""
    for topo in ("tp2", "tp4"):
        for result in _run(case, topo, weights_dir):
            assert {phase: counts for phase, counts in result["collectives"].items()} == dict.fromkeys(
                result["collectives"], {"all_reduce@tp": 4}
            ), (topo, result["rank"])
    assert _run("gpt_neox-sequential", "tp4", weights_dir)[0]["collectives"]["prefill"] == {"all_reduce@attn_tp": 4, "all_reduce@tp": 4}


@pytest.mark.gloo
def test_the_parallel_residual_under_gloo(gloo_world, weights_dir):
    """GPT-NeoX at TP 2 on real gloo ranks: Hugging Face's logits, one all-reduce a layer."""
    job, ref = _case("gpt_neox", weights_dir)
    job = attrs.evolve(job, topology=Topology(tp=2))
    results = gloo_world(2).run(run_rank, Topology(tp=2), job)
    assert rel_error(results, ref) < TOLERANCE["float64"]
    assert all(r["collectives"]["decode1"] == r["collectives"]["prefill"] == {"all_reduce@tp": 4} for r in results)


# --- OLMo-2's q/k norms over the whole projections -----------------------------------------------


def _qk_norm_rank(parallel, heads, kv_heads, rows, counter):
    """This rank's q/k norm output for a projection of `heads` query and `kv_heads` KV heads of
    8 channels, statistics in float64, through a counted group."""
    D, eps = 8, 1e-6
    group = CountingCollectives(parallel.groups["attn_tp"], counter) if counter is not None else parallel.groups["attn_tp"]
    size, rank = group.size, group.rank
    g = torch.Generator().manual_seed(1)
    q_full = torch.randn(rows, heads * D, generator=g, dtype=torch.float64)
    k_full = torch.randn(rows, kv_heads * D, generator=g, dtype=torch.float64)
    q_weight = 1 + 0.1 * torch.randn(heads * D, generator=g, dtype=torch.float64)
    k_weight = 1 + 0.1 * torch.randn(kv_heads * D, generator=g, dtype=torch.float64)
    q_cols = slice(rank * heads * D // size, (rank + 1) * heads * D // size)
    replicas = max(1, size // kv_heads)
    kv_head = rank // replicas
    k_width = max(1, kv_heads // size) * D
    k_cols = slice(kv_head * D, (kv_head + 1) * D) if replicas > 1 else slice(rank * k_width, (rank + 1) * k_width)
    norm = ProjectionQKNorm(q_cols.stop - q_cols.start, k_cols.stop - k_cols.start, heads * D, kv_heads * D, group, eps,
                            counts_k=rank % replicas == 0, dtype=torch.float64, compute_dtype=torch.float64)
    with torch.no_grad():
        norm.q_weight.copy_(q_weight[q_cols])
        norm.k_weight.copy_(k_weight[k_cols])
    q, k = norm(q_full[:, q_cols], k_full[:, k_cols])

    def whole(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    return q, whole(q_full, q_weight)[:, q_cols], k, whole(k_full, k_weight)[:, k_cols]


@pytest.mark.parametrize("tp, kv_heads", [(1, 2), (2, 2), (4, 4), (4, 2), (4, 1)], ids=["tp1", "tp2", "tp4", "tp4-kv2", "tp4-kv1"])
def test_the_projection_statistic_across_ranks_is_the_whole_projection_norm(tp, kv_heads):
    """With float64 statistics the split norm equals the whole one to rounding (replicated KV
    heads counted once); one all_reduce a call, none over one rank."""
    counters = [CollectiveCounter() for _ in range(tp)]
    results = run_threaded(lambda p: _qk_norm_rank(p, 4, kv_heads, 5, counters[p.rank]), Topology(tp=tp))
    for q, q_want, k, k_want in results:
        torch.testing.assert_close(q, q_want, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(k, k_want, rtol=1e-14, atol=1e-14)
    assert all(dict(c.snapshot()) == ({"all_reduce@attn_tp": 1} if tp > 1 else {}) for c in counters)


def test_plan_names_the_qk_statistic_collective():
    *_, lines = build_plan_report("olmo2", None, Topology(tp=2), "ar")
    assert lines["qk_norm"].endswith("all_reduce@attn_tp of [tokens, 2] per layer")
    *_, lines = build_plan_report("olmo2", None, Topology(tp=2, attn_dp=2), "ar")
    assert "nothing (one attention-TP rank)" in lines["qk_norm"]
    *_, lines = build_plan_report("cohere", None, Topology(tp=2), "ar")
    assert "qk_norm" not in lines  # Cohere's q/k norms are per head: nothing crosses ranks


def test_parallel_residual_plan_joins_both_sums():
    """The MLP reads the residual the attention read and carries the attention's partial to its
    exit, where one sum completes both: deferred to the next attention's input, or under
    attention DP reduce-scattered over TP with the attention's partial in its DP slot."""
    _, _, plans, _ = build_plan_report("gpt_neox", None, Topology(tp=2), "ar")
    ffn = next(p for p in plans if p["label"] == "layer1.1:ffn")
    assert ffn["stage"] == "ffn[parallel_residual]"
    ordinary = ffn["variants"]["ordinary"]
    assert ordinary["entry"][0] == "read the residual as the attention read it (its output still pending) with LayerNorm"
    assert "one sum over tp completes both" in ordinary["exit"][0] and "defer that all_reduce@tp" in ordinary["exit"][1]
    attn = next(p for p in plans if p["label"] == "layer1.0:attention")
    assert attn["producer"] == "ffn[parallel_residual]" and "complete" in attn["variants"]["ordinary"]["entry"][0]
    _, _, plans, _ = build_plan_report("cohere", None, Topology(tp=4, attn_dp=2), "rs+rsv")
    exit_lines = next(p for p in plans if p["label"] == "layer1.1:ffn")["variants"]["ordinary"]["exit"]
    assert "attn_tp partial" in exit_lines[0] and "DP rank's slot" in exit_lines[0] and exit_lines[1].startswith("reduce_scatter@tp")


# --- configs refused at parse --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, changes, field",
    [
        ("gpt_neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}}, "partial_rotary_factor"),
        ("gpt_neox", {"head_dim": 8}, "head_dim"),
        ("gpt_neox", {"hidden_size": 66}, "hidden_size"),
        ("cohere", {"hidden_act": "swish2"}, "hidden_act"),
        ("cohere", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("olmo2", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("olmo2", {"num_hidden_layers": 0}, "num_hidden_layers"),
        ("cohere", {"logit_scale": None}, "logit_scale"),
    ],
)
def test_bad_configs_fail_at_parse_naming_the_field(name, changes, field):
    with pytest.raises(ConfigError) as info:
        model_config(name, {**family(name).preset(), **changes})
    message = str(info.value)
    assert field in message and "\n" not in message


def test_gpt_neox_older_rotary_keys_mean_what_hugging_face_reads():
    """`rotary_pct` and `rotary_emb_base` (older GPT-NeoX configs) as transformers maps them."""
    import transformers

    raw = {k: v for k, v in family("gpt_neox").preset().items() if k != "rope_parameters"}
    raw.update(rotary_pct=0.75, rotary_emb_base=500.0, hidden_size=128)
    config = model_config("gpt_neox", raw)
    rope = transformers.AutoConfig.for_model(**raw).rope_parameters
    assert (config.rope_theta, config.rotary_dim) == (rope["rope_theta"], int(32 * rope["partial_rotary_factor"])) == (500.0, 24)


def test_topologies_the_model_cannot_split_fail_naming_the_fix():
    config = model_config("cohere")
    with pytest.raises(ConfigError, match="--attn-cp 1"):
        config.check_topology(Topology(tp=2, attn_cp=2))
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by attention TP 8"):
        config.check_topology(Topology(tp=8))


# --- the norms against Hugging Face's modules ----------------------------------------------------


def _hf_module(module: str, cls: str):
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)


def _filled(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return module


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_norms_compute_what_hugging_face_does_bit_for_bit(dtype):
    """Cohere's LayerNorm (fp32 statistics even for float64), its per-head q/k norm, OLMo-2's
    RMSNorm (the weight before the rounding) and its q/k norm over one rank."""
    from layer_boundary import LayerNorm
    from layer_boundary_models.residual_norms import HeadLayerNorm, Olmo2RMSNorm

    x = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    flat = x.reshape(5, 64)
    ours = _filled(LayerNorm(64, 1e-5, bias=False, dtype=dtype), 1)
    theirs = _hf_module("cohere", "CohereLayerNorm")(64, eps=1e-5).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(ours(flat), theirs(flat))
    heads = _filled(HeadLayerNorm(4, 16, 1e-5, dtype=dtype), 2)
    theirs = _hf_module("cohere", "CohereLayerNorm")((4, 16), eps=1e-5).to(dtype)
    theirs.load_state_dict(heads.state_dict())
    assert torch.equal(heads(x), theirs(x))
    olmo = _filled(Olmo2RMSNorm(64, 1e-6, dtype=dtype), 3)
    theirs = _hf_module("olmo2", "Olmo2RMSNorm")(64, eps=1e-6).to(dtype)
    theirs.load_state_dict(olmo.state_dict())
    assert torch.equal(olmo(flat), theirs(flat))
    qk = ProjectionQKNorm(64, 32, 64, 32, Parallel.single().groups["attn_tp"], 1e-6, dtype=dtype)
    _filled(qk, 4)
    theirs = _hf_module("olmo2", "Olmo2RMSNorm")(64, eps=1e-6).to(dtype)
    theirs.weight.data.copy_(qk.q_weight)
    assert torch.equal(qk(flat, flat[:, :32])[0], theirs(flat))


def test_gpt_neox_layer_norm_matches_torch_to_rounding_in_float64():
    """GPT-NeoX's nn.LayerNorm keeps float64 statistics: so does the core's with compute_dtype=None."""
    from layer_boundary_models.residual_models import make_norm

    ours = _filled(make_norm(model_config("gpt_neox"), dtype=torch.float64), 5)
    theirs = torch.nn.LayerNorm(64, eps=1e-5, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-14, atol=1e-14)
