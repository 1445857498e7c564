"""The 2-GPU correctness check of the flashinfer plugin (run it before the benchmark):

    python -m layer_boundary_flashinfer.gpu_check --out DIR      # spawns 2 ranks (or under torchrun)

1. boundary: the fused all-reduce + add + RMSNorm (and Gemma's (1 + w)) against the unfused
   path and a float64 reference, at token counts across the one-shot/two-shot switch and up to
   the limit; every rank bitwise identical; the limit + 1 falls back unfused (bitwise); a CUDA
   graph of the fused boundary replays what eager computes;
2. finalize: a MoE finalize handoff (top-k combine + shared expert) fused, through the kernel
   (<= 128 tokens) and the torch combine + fused all-reduce (> 128), against the unfused path;
3. models: qwen3 (and gemma, qwen3_moe) at TP=2 in bf16, logits with the plugin on and off
   (and against float32), the all-reduces the fusion removed; a CUDA-graph decode step of
   qwen3 with the plugin on replays what eager computes.

Writes DIR/gpu_check.json, prints PASS/FAIL per check, exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

#: the largest relative error allowed between two bf16 paths of one boundary (the contract's)
BF16_TOL = 2e-2
#: bf16 logits: max |difference| / max |reference|, the tolerance `layer-boundary run` checks with
BF16_LOGITS_TOL = 3e-2

MODEL_SIZES = {
    "qwen3": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192},
    "gemma": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192},
    "qwen3_moe": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 768, "mlp_only_layers": [3]},
}


class Checks:
    def __init__(self, rank: int):
        self.rank, self.items = rank, []

    def add(self, name: str, ok: bool, **facts) -> None:
        self.items.append({"check": name, "ok": bool(ok), **facts})
        if self.rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(facts, default=str)}", flush=True)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _max_rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _same_on_all_ranks(t, group) -> bool:
    gathered = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, t.contiguous(), group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _reference64(partials_sum, residual, norm):
    """The boundary in float64: the sum over ranks + residual, RMSNorm, (1 + w) for Gemma."""
    total = partials_sum.double() + residual.double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + norm.eps)
    return normed * (norm.weight.double() + float(type(norm).offset)), total


def _inputs(tokens, hidden, dtype, rank, seed):
    shared = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    residual = torch.randn(tokens, hidden, generator=shared).to("cuda", dtype)
    partial = torch.randn(tokens, hidden, generator=mine).to("cuda", dtype)
    return residual, partial


def check_boundary(checks, parallel, rank, args):
    from .bench import BoundaryPair
    from .service import prepare_flashinfer_fusion

    group = parallel.groups["tp"].group
    dtype, hidden = torch.bfloat16, args.hidden
    pairs = {gemma: BoundaryPair(parallel, hidden, dtype, torch.device("cuda", torch.cuda.current_device()), gemma=gemma)
             for gemma in (False, True)}
    if rank == 0:
        print("preparing the workspace (the first use on a machine JIT-builds FlashInfer's trtllm_comm: minutes)", flush=True)
    report = prepare_flashinfer_fusion([b for p in pairs.values() for b in p.boundaries], max_tokens=args.max_tokens)
    checks.add("boundary: workspace agreed and candidates bound", report.available and len(report.bound) == 6, report=str(report))
    if not report.available:
        return
    for gemma, pair in pairs.items():
        kind = "gemma" if gemma else "rms"
        for tokens in (1, 2, 3, 64, 127, 128, 129, 511, 1000, args.max_tokens, args.max_tokens + 1):
            residual, partial = _inputs(tokens, hidden, dtype, rank, seed=tokens)
            summed = partial.clone()
            torch.distributed.all_reduce(summed, group=group)
            want_normed, want_residual = pair.norm.add_forward(summed.clone(), residual)
            exact = partial.double()
            torch.distributed.all_reduce(exact, group=group)
            ref_normed, ref_residual = _reference64(exact, residual, pair.norm)
            fwd = pair.start(residual)
            normed, new_residual = pair.step(partial.clone(), fwd)
            torch.cuda.synchronize()
            facts = {"norm": kind, "tokens": tokens, "err_vs_unfused": _rel(normed, want_normed),
                     "err_vs_fp64": _rel(normed, ref_normed), "unfused_err_vs_fp64": _rel(want_normed, ref_normed),
                     "residual_err_vs_fp64": _rel(new_residual, ref_residual),
                     "residual_bitwise_unfused": bool(torch.equal(new_residual, want_residual))}
            same = _same_on_all_ranks(normed, group) and _same_on_all_ranks(new_residual, group)
            if tokens > args.max_tokens:  # above the limit the candidate declines: the core's unfused path, bitwise
                ok = torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
                checks.add("boundary: above the limit the unfused path runs", ok and same, **facts)
                continue
            ok = facts["err_vs_unfused"] <= BF16_TOL and facts["err_vs_fp64"] <= max(2 * facts["unfused_err_vs_fp64"], 1e-3)
            ok = ok and facts["residual_err_vs_fp64"] <= BF16_TOL
            checks.add("boundary: fused equals unfused within bf16, ranks identical", ok and same, ranks_identical=same, **facts)
        # a CUDA graph of a stack entry and three fused boundaries replays what eager computes, on new inputs
        tokens = 7
        residual, partial = _inputs(tokens, hidden, dtype, rank, seed=99)
        static = partial.clone()

        def entry_and_three_boundaries():
            fwd = pair.start(residual)
            return [pair.step(static, fwd) for _ in range(3)]

        graph, outs = _capture(entry_and_three_boundaries, warmup=1)
        static.copy_(_inputs(tokens, hidden, dtype, rank, seed=123)[1])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [(a.clone(), b.clone()) for a, b in outs]
        eager = entry_and_three_boundaries()
        ok = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(replayed, eager))
        checks.add("boundary: CUDA-graph replay equals eager", ok, norm=kind, tokens=tokens)
        del graph


def check_finalize(checks, parallel, rank, args):
    from layer_boundary import MoeFinalizeHandoff, SumGroup

    from .bench import BoundaryPair
    from .service import prepare_flashinfer_fusion

    group = parallel.groups["tp"]
    dtype, hidden, top_k = torch.bfloat16, args.hidden, 8
    pair = BoundaryPair(parallel, hidden, dtype, torch.device("cuda", torch.cuda.current_device()), sparse=True)
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
    checks.add("finalize: the MoE FFN hands its finalize off", report.available and len(report.finalize) == 1, report=str(report))
    if not report.available:
        return
    for tokens in (1, 5, 128, 129, 300):
        for with_shared in (False, True):
            gen = torch.Generator().manual_seed(tokens * 31 + with_shared + 1000 * rank)
            rows = torch.randn(tokens, top_k, hidden, generator=gen).to("cuda", dtype)
            weights = torch.softmax(torch.randn(tokens, top_k, generator=torch.Generator().manual_seed(tokens)), -1).to("cuda", dtype)
            shared = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype) if with_shared else None
            residual, _ = _inputs(tokens, hidden, dtype, rank, seed=tokens + 5)
            idx = torch.zeros(tokens, top_k, dtype=torch.long, device="cuda")

            deferred = []

            def handoff(out):  # what a MoE returns under the exit's flags
                deferred.append(out.defer_moe_finalize)
                made = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT)
                return made if out.defer_moe_finalize else made.finalize_local()

            want = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT).complete()
            want_normed, want_residual = pair.norm.add_forward(want, residual)
            fwd = pair.start(residual)
            normed, new_residual = pair.step(handoff, fwd)
            torch.cuda.synchronize()
            facts = {"tokens": tokens, "shared": with_shared, "path": "kernel" if tokens <= 128 else "torch combine + fused AR",
                     "handed_off": deferred == [True], "err_norm": _rel(normed, want_normed),
                     "err_residual": _rel(new_residual, want_residual)}
            same = _same_on_all_ranks(normed, group.group) and _same_on_all_ranks(new_residual, group.group)
            ok = facts["handed_off"] and facts["err_norm"] <= BF16_TOL and facts["err_residual"] <= BF16_TOL and same
            checks.add("finalize: fused equals unfused within bf16, ranks identical", ok, **facts)


@contextlib.contextmanager
def _plugin_disabled():
    from layer_boundary.plugin import reset_registry

    saved = os.environ.get("LAYER_BOUNDARY_DISABLE_PLUGINS")
    os.environ["LAYER_BOUNDARY_DISABLE_PLUGINS"] = ",".join(filter(None, [saved, "flashinfer"]))
    reset_registry()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LAYER_BOUNDARY_DISABLE_PLUGINS")
        else:
            os.environ["LAYER_BOUNDARY_DISABLE_PLUGINS"] = saved
        reset_registry()


def _build(name, parallel, dtype, state):
    from layer_boundary.models import build_model, family, model_config
    from layer_boundary.models.weights import StateDictSource

    config = model_config(name, dict(family(name).preset, **MODEL_SIZES[name]))
    model = build_model(config, parallel, dtype=dtype, device=f"cuda:{torch.cuda.current_device()}")
    family(name).load_weights(model, StateDictSource(state))
    return config, model.eval()


@torch.inference_mode()
def _logits(model, parallel, prompts, decode_steps):
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.models.attention import StepLayout

    cache = model.new_cache()
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts), device="cuda")
    out = [model(torch.cat(prompts).cuda(), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache).float()]
    for s, ids in enumerate(decode_steps):
        step = StepLayout(slots, [1] * len(prompts), [len(p) + s for p in prompts], device="cuda")
        out.append(model(ids.cuda(), Forward(parallel, len(prompts), mode=ForwardMode.DECODE), step, cache).float())
    return out


def check_model(checks, parallel, rank, name, args):
    from layer_boundary import CollectiveCounter, CountingCollectives
    from layer_boundary.models import family, model_config

    from .service import prepare_flashinfer_fusion

    config = model_config(name, dict(family(name).preset, **MODEL_SIZES[name]))
    state = family(name).random_weights(config, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (17, 9, 33)]
    decode = [torch.randint(0, config.vocab_size, (len(prompts),), generator=gen) for _ in range(2)]
    counters = {}
    logits = {}
    for mode in ("on", "off", "fp32"):
        counter = CollectiveCounter()
        counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        with (_plugin_disabled() if mode != "on" else contextlib.nullcontext()):
            _, model = _build(name, counted, dtype, state)
        if mode == "on":
            report = prepare_flashinfer_fusion(model, max_tokens=args.max_tokens)
            checks.add(f"{name}: workspace agreed and candidates bound", report.available, report=str(report))
        counter.reset()
        logits[mode] = _logits(model, counted, prompts, decode)
        counters[mode] = counter.snapshot()
        del model
        torch.cuda.empty_cache()
    on_off = [_max_rel(a, b) for a, b in zip(logits["on"], logits["off"])]
    on_ref = [_rel(a, b) for a, b in zip(logits["on"], logits["fp32"])]
    off_ref = [_rel(a, b) for a, b in zip(logits["off"], logits["fp32"])]
    top1 = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(logits["on"], logits["off"])]
    # equal within bf16 (as `layer-boundary run` checks logits), and no further from float32 than unfused bf16 is
    ok = max(on_off) <= BF16_LOGITS_TOL and all(a <= 1.25 * b + 1e-3 for a, b in zip(on_ref, off_ref))
    same = all(_same_on_all_ranks(t.cuda(), parallel.groups["tp"].group) for t in logits["on"])
    checks.add(f"{name}: TP=2 bf16 logits equal with the plugin on and off", ok and same, err_on_vs_off=on_off,
               err_on_vs_fp32=on_ref, err_off_vs_fp32=off_ref, top1_agreement=top1, ranks_identical=same)
    ar_on = sum(n for k, n in counters["on"].items() if k.startswith("all_reduce"))
    ar_off = sum(n for k, n in counters["off"].items() if k.startswith("all_reduce"))
    checks.add(f"{name}: the fusion replaced the boundary all-reduces", ar_on < ar_off, collectives_on=counters["on"],
               collectives_off=counters["off"])


def _capture(fn, warmup: int = 2):
    """`fn()` captured in a CUDA graph after eager warm-up; (graph, output). Thread-local capture
    mode, so the NCCL watchdog thread's CUDA calls are not refused while this thread captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def check_graph_decode(checks, parallel, rank, args):
    from layer_boundary.models import family, model_config
    from layer_boundary.models.decode import static_decode_step, static_prefill

    from .service import prepare_flashinfer_fusion

    name = "qwen3"
    config = model_config(name, dict(family(name).preset, **MODEL_SIZES[name]))
    _, model = _build(name, parallel, torch.bfloat16, family(name).random_weights(config, torch.float32, seed=11))
    prepare_flashinfer_fusion(model, max_tokens=args.max_tokens)  # before capture
    batch = 8
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (12,), generator=gen) for _ in range(batch)]
    with torch.inference_mode():
        cache = model.new_static_cache(batch, 24)
        slots = torch.arange(batch, device="cuda")
        ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).cuda()
        pos = torch.full((batch,), 12, dtype=torch.long, device="cuda")
        static_prefill(model, parallel, cache, prompts, "cuda")
        snap = cache.snapshot()
        static_ids, static_pos = ids.clone(), pos.clone()
        graph, out = _capture(lambda: static_decode_step(model, parallel, cache, static_ids, slots, static_pos))
        cache.restore(snap)
        eager = static_decode_step(model, parallel, cache, ids, slots, pos).clone()
        cache.restore(snap)
        graph.replay()
        replayed = out.clone()
    checks.add("qwen3: CUDA-graph decode step (plugin on) replays what eager computes", torch.equal(eager, replayed),
               max_abs_diff=float((eager.float() - replayed.float()).abs().max()))


def _rank(rank: int, world: int, args) -> None:
    import flashinfer

    from layer_boundary import Parallel, Topology

    from .service import default_manager

    parallel = Parallel.from_torch(Topology(tp=world))
    checks = Checks(rank)
    started = time.perf_counter()
    steps = [("boundary", check_boundary), ("finalize", check_finalize)]
    steps += [(f"model {m}", lambda c, p, r, a, m=m: check_model(c, p, r, m, a)) for m in args.models]
    steps += [("graph decode", check_graph_decode)]
    for what, fn in steps:
        if args.only and not any(what.startswith(o) for o in args.only):
            continue
        t0 = time.perf_counter()
        fn(checks, parallel, rank, args)
        if rank == 0:
            print(f"  ({what}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    failed = torch.tensor([sum(not c["ok"] for c in checks.items)], device="cuda")
    torch.distributed.all_reduce(failed)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(), "world": world, "flashinfer": flashinfer.__version__,
                  "torch": torch.__version__, "fast_path": dict(default_manager().backend.fast_path),
                  "seconds": time.perf_counter() - started, "checks": checks.items}
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"{len(checks.items) - int(failed.item())}/{len(checks.items)} checks passed (all ranks); "
              f"fast path {result['fast_path']}; wrote {out / 'gpu_check.json'}", flush=True)
    if failed.item():
        raise SystemExit(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/flashinfer_gpu_check")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--models", nargs="*", default=["qwen3", "gemma", "qwen3_moe"])
    ap.add_argument("--only", nargs="*", help="run only the steps whose names start with these")
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the flashinfer GPU check needs 2 CUDA GPUs")
    from .ranks import run_ranks

    run_ranks(_rank, (args,), args.gpus)


if __name__ == "__main__":
    main()
