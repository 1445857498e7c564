"""Compiled decode on the GPU (group `compile` of scripts/gpu_tests.sh), and its CPU twin.

- qwen3 TP=1 decode through a static KV cache, `torch.compile(mode="reduce-overhead",
  fullgraph=True)` (Inductor + CUDA graphs), equals the eager step; its step time against
  `CapturedStep` (our own CUDA graph of the eager step) is reported, not asserted
  (printed, and written to $LAYER_BOUNDARY_COMPILE_JSON or benchmarks/results/compile_gpu.json).
- TP=2 with the flashinfer plugin in the shared-device world (both ranks on one GPU when it is
  the only one), compiled fullgraph, equal to eager on every rank, its fused candidates graph
  nodes (`layer_boundary_flashinfer::all_reduce_add_rmsnorm`). Before they were ops, tracing
  stopped in the first chosen candidate (its launch reads `data_ptr()` and calls FlashInfer's
  JIT module, which FlashInfer does not register as an op): the likely failure of this group.
  Every failure prints the numbers per step (relative and absolute difference, argmax agreement,
  finiteness) and Dynamo's break reasons.

The CPU twin compiles the same static decode step (backend "eager") so the path is checked on
every run of the suite."""

import json
import logging
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from layer_boundary import Forward, ForwardMode, Parallel, Topology
from layer_boundary.compiling import CountingBackend, graph_breaks, reset_graph_breaks
from layer_boundary_models import build_model, family, model_config
from layer_boundary.plugin import DecodeLayout
from layer_boundary.cli.static_decode import static_prefill
from layer_boundary.cli.runner import make_requests
from layer_boundary.plugin import StateDictSource

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(name, dtype, device, parallel=None, layers=None):
    hf = dict(model_config(name).hf)
    if layers:
        hf["num_hidden_layers"] = layers
    config = model_config(name, hf)
    state = family(name).random_weights(config, dtype, seed=5)
    model = build_model(config, parallel or Parallel.single(), dtype=dtype, device=device)
    family(name).load_weights(model, StateDictSource(state))
    return config, model.eval()


def _decode(model, parallel, cache, ids, slots, positions, run=None):
    """One static decode step; the engine's pattern: Forward built here, outside `run`."""
    fwd = Forward(parallel, ids.shape[0], mode=ForwardMode.DECODE)
    return (model if run is None else run)(ids, fwd, DecodeLayout(slots, positions), cache)


def _steps(config, batch, steps, device):
    prompts, decode = make_requests(config.vocab_size, batch, 6, steps, seed=3)
    base = torch.tensor([len(p) for p in prompts], device=device)
    return prompts, [torch.tensor(t, device=device) for t in decode], base


@pytest.mark.parametrize("slots_given", [True, False], ids=["slots_gathered", "rows_are_slots"])
@torch.inference_mode()
def test_cpu_twin_static_decode_compiles_whole(slots_given):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch._dynamo.reset()
        reset_graph_breaks()
        parallel = Parallel.single()
        config, model = _model("qwen3", torch.float64, "cpu", layers=2)
        prompts, decode, base = _steps(config, 4, 4, "cpu")
        cache = model.new_static_cache(len(prompts), 16)
        static_prefill(model, parallel, cache, prompts, "cpu")
        slots = torch.arange(len(prompts)) if slots_given else None
        backend = CountingBackend("eager")
        run = torch.compile(model, backend=backend, fullgraph=True)
        for s, ids in enumerate(decode):
            snap = cache.snapshot()
            eager = _decode(model, parallel, cache, ids, slots, base + s).clone()
            cache.restore(snap)
            assert torch.equal(_decode(model, parallel, cache, ids, slots, base + s, run), eager)
        assert graph_breaks() == 0 and backend.graphs == 1  # positions are tensors: one graph for every step
    finally:
        torch.set_num_threads(threads)


def _difference(compiled, eager) -> dict:
    """How far compiled logits are from eager ones: what a failure message prints."""
    diff = (compiled - eager).abs()
    finite = bool(torch.isfinite(compiled).all())
    scale = eager.abs().max().clamp_min(1e-6)
    return {
        "relative": float("inf") if not finite else (diff.max() / scale).item(),
        "max_abs": diff.max().item(),
        "eager_max": eager.abs().max().item(),
        "argmax_agree": float((compiled.argmax(-1) == eager.argmax(-1)).float().mean().item()),
        "finite": finite,
    }


def _break_reasons() -> list:
    from torch._dynamo.utils import counters

    return [reason[:300] for reason in list(counters["graph_break"]) + list(counters["unimplemented"])]


class _CompileLog(logging.Handler):
    """Dynamo's and Inductor's messages on recompiles and CUDA graph skips, kept for a failure
    message (the reason a `reduce-overhead` step runs uncaptured is only ever logged)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if "cudagraph" in text.lower() or "recompil" in text.lower():
            self.lines.append(text[:600])


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _median_us(fn, repeats=50):
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _host_us(fn, repeats=50):
    """The host's time to issue `fn` (no wait for the GPU after it): what a call costs before
    its kernels or graph are queued, the part a per-step sync cannot hide."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _pipelined_us(fn, steps=50, repeats=5):
    """Per step of `steps` calls issued back to back with one wait at the end (median of
    `repeats`): a decode loop that does not sync each step (async scheduling), where a call's
    host time overlaps the previous step's GPU time and the slower of the two sets the pace."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6 / steps)
    return statistics.median(samples)


def _host_profile(fn, calls=30, top=18) -> list:
    """Where a call's host time goes: cProfile's top functions by own time over `calls` calls."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile).sort_stats("tottime")
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in list(stats.stats.items()):
        rows.append((tottime, f"{Path(file).name}:{line}({name})", ncalls // calls, tottime / calls * 1e6, cumtime / calls * 1e6))
    return [{"fn": where, "calls_per_step": n, "own_us": round(own, 1), "cum_us": round(cum, 1)}
            for _, where, n, own, cum in sorted(rows, reverse=True)[:top]]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [4, 32])
@torch.inference_mode()
def test_reduce_overhead_decode_equals_eager_and_is_timed_against_captured_step(batch):
    from layer_boundary._cuda_graphs import CapturedStep

    torch._dynamo.reset()
    reset_graph_breaks()
    from torch._dynamo.utils import counters

    counters.clear()
    torch._logging.set_logs(perf_hints=True, recompiles=True)
    log = _CompileLog()
    logging.getLogger("torch").addHandler(log)
    parallel = Parallel.single()
    config, model = _model("qwen3", torch.bfloat16, "cuda")
    prompts, decode, base = _steps(config, batch, 4, "cuda")
    cache = model.new_static_cache(len(prompts), 32)
    slots = torch.arange(len(prompts), device="cuda")
    ids0 = torch.zeros(len(prompts), dtype=torch.long, device="cuda")
    pos0 = torch.zeros(len(prompts), dtype=torch.long, device="cuda")
    captured = CapturedStep(lambda i, p: _decode(model, parallel, cache, i, slots, p), (ids0, pos0))
    static_prefill(model, parallel, cache, prompts, "cuda")
    run = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    per_step = []
    for s, ids in enumerate(decode):
        snap = cache.snapshot()
        eager = _decode(model, parallel, cache, ids, slots, base + s).float().clone()
        cache.restore(snap)
        compiled = _decode(model, parallel, cache, ids, slots, base + s, run).float().clone()
        cache.restore(snap)
        per_step.append(_difference(compiled, eager))
        _decode(model, parallel, cache, ids, slots, base + s)  # advance the cache as eager does
    worst = max(d["relative"] for d in per_step)
    print(f"\nreduce-overhead vs eager (batch {batch}), per step: {per_step}")
    print(f"compile log (cudagraph skips {_cudagraph_skips()}): {log.lines}")
    assert graph_breaks() == 0, f"{graph_breaks()} graph breaks: {_break_reasons()}"
    # captured, not merely compiled: Inductor's CUDA graph trees took every step (no skip reason)
    assert _cudagraph_skips() == 0, f"the compiled step ran without a CUDA graph: {log.lines}"
    assert worst < 2e-2, f"compiled vs eager, per step: {per_step}"  # bf16, Inductor's own fusions
    ids, pos = decode[0], base
    snap = cache.snapshot()
    # what an engine's own graph runner does instead: Inductor's step (no CUDA graph trees)
    # captured whole by CapturedStep, which replays with no per-call guard or tree bookkeeping
    inductor = torch.compile(model, fullgraph=True)
    eager = _decode(model, parallel, cache, ids, slots, pos).float().clone()
    cache.restore(snap)
    captured_compiled = CapturedStep(lambda i, p: _decode(model, parallel, cache, i, slots, p, inductor), (ids0.clone(), pos0.clone()))
    cache.restore(snap)
    compiled_captured = _difference(captured_compiled.replay(ids, pos).float(), eager)
    cache.restore(snap)
    assert compiled_captured["relative"] < 2e-2, f"the captured compiled step vs eager: {compiled_captured}"
    timings = {
        "batch": batch,
        "eager_us": _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos)),
        "captured_step_us": _median_us(lambda: captured.replay(ids, pos)),
        "reduce_overhead_us": _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "compiled_captured_step_us": _median_us(lambda: captured_compiled.replay(ids, pos)),
        "captured_step_pipelined_us": _pipelined_us(lambda: captured.replay(ids, pos)),
        "reduce_overhead_pipelined_us": _pipelined_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "compiled_captured_step_pipelined_us": _pipelined_us(lambda: captured_compiled.replay(ids, pos)),
        "captured_step_host_us": _host_us(lambda: captured.replay(ids, pos)),
        "reduce_overhead_host_us": _host_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "relative_max_diff": worst,
        "compiled_captured_relative_diff": compiled_captured["relative"],
        "cudagraph_skips": _cudagraph_skips(),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "device": torch.cuda.get_device_name(),
    }
    # the same calls without Dynamo's guard evaluation (only safe when nothing a guard checks changes)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        timings["reduce_overhead_skip_guards_us"] = _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run))
        timings["reduce_overhead_skip_guards_host_us"] = _host_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run))
    timings["reduce_overhead_host_profile"] = _host_profile(lambda: _decode(model, parallel, cache, ids, slots, pos, run))
    # reduce-overhead's CUDA graphs without the trees' bookkeeping (one graph per shape, inputs
    # copied in, replayed): Inductor's `triton.cudagraph_trees=False`
    torch._dynamo.reset()
    plain_graphs = torch.compile(model, fullgraph=True, options={"triton.cudagraphs": True, "triton.cudagraph_trees": False})
    cache.restore(snap)
    for _ in range(3):  # compile, record, replay
        plain_out = _decode(model, parallel, cache, ids, slots, pos, plain_graphs).float().clone()
        cache.restore(snap)
    timings["cudagraphs_no_trees_relative_diff"] = _difference(plain_out, eager)["relative"]
    timings["cudagraphs_no_trees_us"] = _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos, plain_graphs))
    timings["cudagraphs_no_trees_host_us"] = _host_us(lambda: _decode(model, parallel, cache, ids, slots, pos, plain_graphs))
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        timings["cudagraphs_no_trees_skip_guards_us"] = _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos, plain_graphs))
    cache.restore(snap)
    logging.getLogger("torch").removeHandler(log)
    torch._logging.set_logs()
    print(f"\ncompiled decode (qwen3 TP=1, batch {batch}): {json.dumps(timings)}")
    out = Path(os.environ.get("LAYER_BOUNDARY_COMPILE_JSON", "benchmarks/results/compile_gpu.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[f"batch{batch}"] = timings
    out.write_text(json.dumps(previous, indent=2))


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_reduce_overhead_at_the_bench_size_against_captured_step():
    """`bench decode`'s qwen3 (hidden 4096, 8 layers, bf16; the torch path, no plugin kernels)
    at batch 1: where the GPU's time per step dwarfs the host's, `reduce-overhead` against
    `CapturedStep`, synced every step and pipelined (timings recorded, not asserted)."""
    from layer_boundary._cuda_graphs import CapturedStep
    from layer_boundary.bench.decode import _random_init
    from layer_boundary_models.presets import realistic

    torch._dynamo.reset()
    reset_graph_breaks()
    parallel = Parallel.single()
    config = model_config("qwen3", realistic("qwen3"))
    model = build_model(config, parallel, dtype=torch.bfloat16, device="cuda").eval()
    _random_init(model)
    prompts, decode, base = _steps(config, 1, 2, "cuda")
    cache = model.new_static_cache(len(prompts), 40)
    static_prefill(model, parallel, cache, prompts, "cuda")
    slots = torch.arange(len(prompts), device="cuda")
    ids, pos = decode[0], base
    snap = cache.snapshot()
    eager = _decode(model, parallel, cache, ids, slots, pos).float().clone()
    # CapturedStep timed first and released before compiling: the two graphs' pools never
    # meet (run together, this size hit an illegal memory access once; see the closing note)
    captured = CapturedStep(lambda i, p: _decode(model, parallel, cache, i, slots, p), (ids.clone(), pos.clone()))
    timings = {"model": "bench decode qwen3 (hidden 4096, 8 layers, bf16, torch path)", "batch": 1,
               "captured_step_us": _median_us(lambda: captured.replay(ids, pos)),
               "captured_step_pipelined_us": _pipelined_us(lambda: captured.replay(ids, pos))}
    captured = None  # the graph and its pool go before the trees record
    torch.cuda.synchronize()
    run = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        cache.restore(snap)
        compiled = _decode(model, parallel, cache, ids, slots, pos, run).float().clone()
    torch.cuda.synchronize()
    difference = _difference(compiled, eager)
    assert graph_breaks() == 0 and difference["relative"] < 3e-2, difference
    timings.update({
        "reduce_overhead_us": _median_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "reduce_overhead_pipelined_us": _pipelined_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "reduce_overhead_host_us": _host_us(lambda: _decode(model, parallel, cache, ids, slots, pos, run)),
        "relative_diff": difference["relative"], "cudagraph_skips": _cudagraph_skips(),
    })
    cache.restore(snap)
    print(f"\ncompiled decode at the bench size: {json.dumps(timings)}")
    out = Path(os.environ.get("LAYER_BOUNDARY_COMPILE_JSON", "benchmarks/results/compile_gpu.json"))
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous["bench_size_batch1"] = timings
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(previous, indent=2))


@torch.inference_mode()  # an engine's decode: custom ops have no autograd formula, and need none
def _flashinfer_rank(parallel, name: str = "qwen3", steps: int = 3):
    """A TP=2 model (`name`) with the flashinfer plugin's fused candidates, decode compiled
    fullgraph against the same model eager, on this rank."""
    from layer_boundary._lifecycle import prepare_model, release_model

    torch._dynamo.reset()
    reset_graph_breaks()
    device = f"cuda:{torch.cuda.current_device()}"
    config, model = _model(name, torch.bfloat16, device, parallel=parallel)
    prompts, decode, base = _steps(config, 4, steps, device)
    prepare_model(model, max_tokens=sum(len(p) for p in prompts))
    return _compiled_against_eager(parallel, config, model, prompts, decode, base, device, "flashinfer", release_model)


def _compiled_against_eager(parallel, config, model, prompts, decode, base, device, plugin, release):
    """Decode steps of a prepared TP model compiled fullgraph (Inductor) against eager, with the
    graph's op nodes of `plugin`, on this rank; `release(model)` afterwards, whatever happened."""
    cache = model.new_static_cache(len(prompts), 32)
    static_prefill(model, parallel, cache, prompts, device)
    slots = torch.arange(len(prompts), device=device)
    backend = CountingBackend("inductor")
    run = torch.compile(model, backend=backend, fullgraph=True)
    per_step, error = [], None
    try:
        for s, ids in enumerate(decode):
            snap = cache.snapshot()
            eager = _decode(model, parallel, cache, ids, slots, base + s).float().clone()
            cache.restore(snap)
            compiled = _decode(model, parallel, cache, ids, slots, base + s, run).float().clone()
            per_step.append(_difference(compiled, eager))
    except Exception as exc:  # noqa: BLE001 - reported with the rank's numbers, then failed by the test
        error = f"{type(exc).__name__}: {str(exc)[:1500]}"
    finally:
        release(model)
    ops = [str(t) for t in backend.ops() if plugin in str(t) or "layer_boundary" in str(t)]
    fused_prefix = {"flashinfer": "layer_boundary_flashinfer.all_reduce_add_rmsnorm", "cutedsl": "layer_boundary_cutedsl.oneshot"}
    fused = sum(op.startswith(fused_prefix[plugin]) for op in ops)
    return {"rank": parallel.rank, "graph_breaks": graph_breaks(), "graphs": backend.graphs, "per_step": per_step,
            "worst": max((d["relative"] for d in per_step), default=float("inf")), "ops": sorted(set(ops)), "fused_nodes": fused,
            "error": error, "breaks": _break_reasons()}


def _report(results, what: str) -> None:
    for r in results:
        print(f"\nrank {r['rank']}: graphs {r['graphs']}, graph breaks {r['graph_breaks']}, fused nodes {r['fused_nodes']}, "
              f"ops {r['ops']}, per step {r['per_step']}, error {r['error']}, breaks {r['breaks']}")
    for r in results:
        assert r["error"] is None, f"rank {r['rank']}: {r['error']}"
        assert r["graph_breaks"] == 0, f"rank {r['rank']}: {r['breaks']}"
        # the flashinfer candidates were chosen, each one node (every owed input after the first layer's attention)
        assert r["fused_nodes"] > 0, f"rank {r['rank']}: no fused {what} node in {r['ops']}"
        assert r["worst"] < 2e-2, f"rank {r['rank']}: compiled vs eager per step {r['per_step']}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_tp2_flashinfer_compiled_fullgraph_equals_eager(gpu_world, name):
    """qwen3_moe's MoE sum takes the fused all-reduce too: FlashInfer's finalize kernel is
    declined on CUDA (see tests/plugins/test_fused_ops_gpu.py), and a compiled MoE runs every
    owned expert densely (`dense_experts`)."""
    pytest.importorskip("layer_boundary_flashinfer")
    _report(gpu_world(2).run(_flashinfer_rank, Topology(tp=2), name), "all-reduce + add + RMSNorm")


@torch.inference_mode()
def _cutedsl_rank(parallel, steps: int = 3):
    """A TP=2 qwen3_moe (hidden 1024: the kernels' CTAs have 4 warps) with the CuTe DSL one-shot
    fusion installed and prepared, decode compiled fullgraph against eager, on this rank."""
    from layer_boundary_cutedsl import CuteDSLFusion, install_cutedsl_fusion, prepare_cutedsl_fusion, release_cutedsl_fusion

    torch._dynamo.reset()
    reset_graph_breaks()
    device = f"cuda:{torch.cuda.current_device()}"
    hf = dict(model_config("qwen3_moe").hf, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
              intermediate_size=2048, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4)
    config = model_config("qwen3_moe", hf)
    model = build_model(config, parallel, dtype=torch.bfloat16, device=device, fusions=CuteDSLFusion()).eval()
    family("qwen3_moe").load_weights(model, StateDictSource(family("qwen3_moe").random_weights(config, torch.bfloat16, seed=5)))
    prompts, decode, base = _steps(config, 4, steps, device)
    install_cutedsl_fusion(model)
    prepare_cutedsl_fusion(model, max_tokens=64)
    return _compiled_against_eager(parallel, config, model, prompts, decode, base, device, "cutedsl", release_cutedsl_fusion)


@pytest.mark.gpu
@needs_gpu
def test_tp2_cutedsl_compiled_fullgraph_equals_eager(gpu_world):
    pytest.importorskip("layer_boundary_cutedsl")
    pytest.importorskip("cutlass")
    _report(gpu_world(2).run(_cutedsl_rank, Topology(tp=2), timeout=400), "one-shot all-reduce + add + RMSNorm")
