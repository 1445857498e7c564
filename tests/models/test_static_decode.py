"""The fixed-shape decode path (static KV cache, no host sync) equals HF and the per-request
cache's path, traces whole under torch.compile, and on a GPU a CUDA graph of a whole decode step
replays exactly what the eager step computes; every family with a real-width config for `bench
decode` parses it, builds it and makes a static cache."""

import pytest
import torch

from layer_boundary import Forward, ForwardMode, Parallel
from layer_boundary.plugin import StepLayout
from layer_boundary_models import build_model, family, model_config
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary.cli.runner import make_requests


#: a case's family and its changes to the family's preset (the static decode tests' cases)
CASES = {"gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False})}
#: every family with a static cache: the dense and MoE decoder, the sandwich families, the
#: residual families (GPT-NeoX's partial rotary with its parallel and sequential residual,
#: OLMo-2's post-norm, Cohere's interleaved rotary)
STATIC_FAMILIES = ["qwen3", "qwen3_moe", "gemma2", "gemma3", "olmo2", "gpt_neox", "gpt_neox-sequential", "cohere"]


def _model(case, dtype, device="cpu", layers=None):
    name, changes = CASES.get(case, (case, {}))
    raw = {**family(name).preset(), **changes}
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if "layer_types" in raw:  # the sandwich presets': sliding, full, ...
            raw["layer_types"] = raw["layer_types"][:layers]
    config = model_config(name, raw)
    state = family(name).random_weights(config, dtype, seed=5)
    model = build_model(config, Parallel.single(), dtype=dtype, device=device)
    from layer_boundary.plugin import StateDictSource

    family(name).load_weights(model, StateDictSource(state))
    return config, state, model.eval()


#: decode's allowed logit difference: HF's fp32 softmax probabilities differ from this path's by
#: fp32 rounding; the sandwich families' post-norms rescale each sublayer's output to unit RMS,
#: so that rounding reaches their logits a few times larger (measured: ~1.5e-6), as Cohere's
#: per-head q/k LayerNorms do to its scores (measured: 1.5e-6; with the softmax in float64 its
#: static path equals the per-request cache's exactly)
DECODE_ATOL = {"gemma2": 5e-6, "gemma3": 5e-6, "cohere": 5e-6}


@pytest.mark.parametrize("name", STATIC_FAMILIES)
@pytest.mark.parametrize("order", ["rows_are_slots", "reversed_slots"])
@torch.inference_mode()
def test_static_cache_decode_matches_hf(name, order):
    """Prefill agrees to 1e-10 in float64. Decode attends over the padded cache length: HF's
    fp32 softmax (which this path mirrors) then sums a different number of terms, so agreement
    is at fp32 softmax precision (1e-6, `DECODE_ATOL`), still far below any real error. The
    sandwich families' prompts outrun their sliding window, so decode reads the window's mask.

    `rows_are_slots`: decode row i is request i in slot i (`slots=None`, the cache read in
    place); `reversed_slots`: row i is the request in slot n-1-i (the slots gathered)."""
    config, state, model = _model(name, torch.float64)
    prompts, decode = make_requests(config.vocab_size, 3, 5, 3, seed=2)
    ref = hf_logits(hf_from_state(dict(config.hf), state, torch.float64), [torch.tensor(p) for p in prompts], decode)
    cache = model.new_static_cache(len(prompts), 16)
    parallel = Parallel.single()
    logits = static_prefill(model, parallel, cache, prompts, "cpu")
    start = 0
    for r, p in enumerate(prompts):
        assert torch.allclose(logits[start : start + len(p)], ref[r][0], rtol=0, atol=1e-10)
        start += len(p)
    requests = list(range(len(prompts)))[:: -1 if order == "reversed_slots" else 1]  # request of each row
    slots = torch.tensor(requests) if order == "reversed_slots" else None
    positions = torch.tensor([len(prompts[r]) for r in requests])
    for s, tokens in enumerate(decode):
        out = static_decode_step(model, parallel, cache, torch.tensor([tokens[r] for r in requests]), slots, positions + s)
        for row, r in enumerate(requests):
            assert torch.allclose(out[row], ref[r][s + 1][0], rtol=0, atol=DECODE_ATOL.get(name, 1e-6))


def _dynamic_logits(model, prompts, decode) -> list:
    """Prefill and decode steps through the per-request cache (`new_cache()`): logits per step."""
    parallel, cache = Parallel.single(), model.new_cache()
    rids = list(range(len(prompts)))
    ids = torch.cat([torch.tensor(p) for p in prompts])
    out = [model(ids, Forward(parallel, len(ids), mode=ForwardMode.EXTEND), StepLayout(rids, [len(p) for p in prompts], [0] * len(rids)), cache)]
    for s, tokens in enumerate(decode):
        step = StepLayout(rids, [1] * len(rids), [len(p) + s for p in prompts])
        out.append(model(torch.tensor(tokens), Forward(parallel, len(tokens), mode=ForwardMode.DECODE), step, cache))
    return out


@pytest.mark.parametrize("name", STATIC_FAMILIES)
@torch.inference_mode()
def test_static_cache_decode_equals_the_per_request_cache(name, monkeypatch):
    """The static cache's prefill and decode steps compute what the per-request cache's do, to
    float64 rounding: the rotary table holds the factors the dynamic path computes (GPT-NeoX's
    partial rotary, Cohere's interleaved pairs, OLMo-2's fp32 factors), the window mask hides
    what the growing cache's does. Both paths' softmax runs in float64 here: in fp32 (HF's, which
    both mirror) decode's sum over the padded cache length rounds differently (`DECODE_ATOL`)."""
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim, dtype=None: softmax(x, dim=dim))
    config, _, model = _model(name, torch.float64, layers=2)
    prompts, decode = make_requests(config.vocab_size, 3, 6, 3, seed=4)  # longer than the sandwich windows
    want = _dynamic_logits(model, prompts, decode)
    parallel = Parallel.single()
    cache = model.new_static_cache(len(prompts), 12)
    assert torch.allclose(static_prefill(model, parallel, cache, prompts, "cpu"), want[0], rtol=0, atol=1e-12)
    base = torch.tensor([len(p) for p in prompts])
    for s, tokens in enumerate(decode):
        got = static_decode_step(model, parallel, cache, torch.tensor(tokens), None, base + s)
        assert torch.allclose(got, want[s + 1], rtol=0, atol=1e-12), f"step {s}: {(got - want[s + 1]).abs().max().item()}"


@pytest.mark.parametrize("name", ["gemma3", "olmo2", "gpt_neox", "gpt_neox-sequential", "cohere"])
def test_static_decode_step_compiles_whole(name):
    """A decode step of the sandwich and residual families traces as one graph under
    `torch.compile(fullgraph=True)` (what CUDA-graph capture by the compiler needs), equal to the
    eager step."""
    from compiled_decode import compiled_decode_graph, reset_compiler

    reset_compiler()
    with torch.inference_mode():
        config, _, model = _model(name, torch.float64, layers=2)
        compiled_decode_graph(model, config)


@torch.inference_mode()
def test_rows_as_slots_refuse_more_rows_than_slots():
    config, _, model = _model("qwen3", torch.float32)
    cache = model.new_static_cache(2, 8)
    with pytest.raises(ValueError, match="needs as many cache slots; this cache has 2"):
        static_decode_step(model, Parallel.single(), cache, torch.tensor([1, 2, 3]), None, torch.tensor([0, 0, 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", STATIC_FAMILIES)
@torch.inference_mode()
def test_cuda_graph_decode_step_replays_the_eager_step(name):
    from layer_boundary._cuda_graphs import CapturedStep

    config, _, model = _model(name, torch.bfloat16, device="cuda")
    parallel = Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 4, 6, 4, seed=3)
    cache = model.new_static_cache(len(prompts), 32)
    slots = torch.arange(len(prompts), device="cuda")
    ids = torch.zeros(len(prompts), dtype=torch.long, device="cuda")
    pos = torch.zeros(len(prompts), dtype=torch.long, device="cuda")
    graph = CapturedStep(lambda i, p: static_decode_step(model, parallel, cache, i, slots, p), (ids, pos))
    static_prefill(model, parallel, cache, prompts, "cuda")
    base = torch.tensor([len(p) for p in prompts], device="cuda")
    for s, tokens in enumerate(decode):
        step_ids = torch.tensor(tokens, device="cuda")
        snap = cache.snapshot()
        eager = static_decode_step(model, parallel, cache, step_ids, slots, base + s).clone()
        cache.restore(snap)
        replayed = graph.replay(step_ids, base + s).clone()
        assert torch.equal(eager, replayed), f"step {s}: max diff {(eager - replayed).abs().max().item()}"


#: the families `bench decode` times at a real width (their records' `realistic()`)
REALISTIC = ["qwen3", "gemma3", "gpt_neox"]


@pytest.mark.parametrize("name", REALISTIC)
def test_a_realistic_config_parses_builds_and_makes_a_static_cache(name):
    """What `bench decode --model NAME` needs before its GPU: the record's real-width config, with
    the bench's layer count, parses; the model builds (on the meta device: no memory) with the
    parameters Hugging Face's model of the same dict has (the bench's comparison), its layer types
    and rope as Hugging Face reads them; and it makes a static cache."""
    import transformers

    from layer_boundary.bench.decode import realistic_config
    from layer_boundary.cli.families import build, family_config, find_family

    item = find_family(name)
    raw = realistic_config(item, 6)
    config = family_config(item, raw)
    assert config.num_layers == 6 and config.hidden_size >= 2048 and config.vocab_size == 32000
    hf_config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    if name == "gemma3":  # five sliding-window layers to one global one, at any layer count
        assert config.layer_types == tuple(hf_config.layer_types) == ("sliding_attention",) * 5 + ("full_attention",)
        assert (config.sliding_window, config.rope["full_attention"].factor) == (1024, 8.0)
    if name == "gpt_neox":
        assert config.rotary_dim == 32 and config.residual == "parallel"
    model = build(item, config, Parallel.single(), dtype=torch.bfloat16, device="meta")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    cache = model.new_static_cache(2, 40)
    assert cache.k[0].shape == (2, config.num_kv_heads, 40, config.head_dim) and len(cache.k) == 6
