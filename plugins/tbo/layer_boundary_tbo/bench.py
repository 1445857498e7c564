"""`layer-boundary bench tbo`: two-batch overlap (TBO) on GPUs: is a step faster than its two
microbatches run apart?

For one prefill-sized batch through a reference model (no KV cache) it times, per rank, with CUDA
events (median of --iters after --warmup):

  whole        the batch without TBO
  half0/half1  each microbatch's requests alone, without TBO (their sum is the "serial sum")
  tbo-1stream  TBO with the microbatches interleaved on one stream (no device overlap)
  tbo-2streams TBO with one CUDA stream per microbatch (one's NCCL sum under the other's compute)

It first checks that TBO's logits match the whole batch's. Overlap shows as tbo-2streams below
the serial sum (and below tbo-1stream). With --trace DIR, rank 0 also writes a Chrome trace of one
tbo-2streams step (open it in chrome://tracing or Perfetto: the two streams' kernels interleave).

On a machine with 2 GPUs (TP=2 over NCCL):

    layer-boundary bench tbo -- --gpus 2 --trace $OUT

`--device cpu` runs the same steps over gloo as a dry run (its timings mean nothing; the test
suite runs it that way). JSON to --out.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from layer_boundary.plugin import OneLineParser, mark_loaded, non_negative_int, positive_int

MODES = ("whole", "half0", "half1", "tbo-1stream", "tbo-2streams")


def ensure_plugin() -> None:
    from layer_boundary_tbo.plugin import register_in_process

    register_in_process()


def _family(name: str):
    """The registered model family `name` (the reference ones come with layer-boundary-models)."""
    from layer_boundary.plugin import get_registry

    found = get_registry().families_of(name)
    if not found:
        raise SystemExit(f"bench tbo: no model family {name!r} is installed (pip install layer-boundary-models)")
    return found[0]


def model_hf_config(args) -> dict:
    raw = dict(_family(args.model).record.preset())
    raw.update(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
    )
    if args.model == "qwen3_moe":
        raw.update(num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.intermediate // 4, mlp_only_layers=[])
    return raw


@torch.no_grad()
def _init(model, seed: int) -> None:
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    mark_loaded(model)  # every parameter written: the model's forward runs


def measure_rank(parallel, spec: dict) -> dict:
    """Build the model on this rank, check TBO against the whole batch, time every mode."""
    ensure_plugin()
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.plugin import BuildRequest, StepLayout, select

    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec["dtype"]]
    item = _family(spec["model"])
    config = item.record.parse(dict(spec["hf_config"]))
    request = BuildRequest(config=config, parallel=parallel, reduction=spec["reduction"], dtype=dtype, device=device, options={"tbo": True})
    model = select("model_families", (request,), records=(item,), subject="bench tbo", error_type=None).value.eval()
    _init(model, spec["seed"])
    n_req, length = spec["requests"], spec["tokens_per_request"]
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, config.vocab_size, (n_req * length,), generator=gen).to(device)
    half = n_req // 2

    def step(requests, extras):
        rows = slice(requests[0] * length, (requests[-1] + 1) * length)
        layout = StepLayout(list(requests), [length] * len(requests), [0] * len(requests), device=device)
        fwd = Forward(parallel, layout.num_tokens, mode=ForwardMode.EXTEND, extras=dict(extras))
        return model(ids[rows], fwd, layout, None)

    runs = {
        "whole": lambda: step(range(n_req), {}),
        "half0": lambda: step(range(half), {}),
        "half1": lambda: step(range(half, n_req), {}),
        "tbo-1stream": lambda: step(range(n_req), {"tbo": True, "tbo_streams": False}),
        "tbo-2streams": lambda: step(range(n_req), {"tbo": True, "tbo_streams": True}),
    }
    with torch.inference_mode():
        whole = runs["whole"]().float()
        checks = {}
        for mode in ("tbo-1stream", "tbo-2streams"):
            out = runs[mode]().float()
            checks[mode] = ((out - whole).abs().max() / whole.abs().max()).item()
        timings = {mode: _time(fn, spec, device) for mode, fn in runs.items()}
        trace = None
        if spec.get("trace") and parallel.rank == 0 and device.type == "cuda":
            trace = _trace(runs["tbo-2streams"], spec["trace"])
    return {"rank": parallel.rank, "checks": checks, "timings": timings, "trace": trace}


def _time(fn, spec, device) -> dict:
    cuda = device.type == "cuda"
    for _ in range(spec["warmup"]):
        fn()
    gpu_ms, cpu_ms = [], []
    for _ in range(spec["iters"]):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        cpu_ms.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu_ms.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(gpu_ms if cuda else cpu_ms), "launch_ms": statistics.median(cpu_ms)}


def _trace(fn, folder: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = str(Path(folder) / "tbo_2streams_trace.json")
    prof.export_chrome_trace(path)
    return path


def main(argv=None) -> int:
    p = OneLineParser(prog="layer-boundary bench tbo", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=positive_int, default=2, help="ranks (TP size); one GPU each")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="qwen3", choices=["qwen3", "qwen3_moe"], help="qwen3's compute has no host syncs")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--intermediate", type=positive_int, default=12288)
    p.add_argument("--experts", type=positive_int, default=16)
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--requests", type=positive_int, default=8, help="even: the microbatches split at a request boundary")
    p.add_argument("--tokens-per-request", type=positive_int, default=512)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", default="benchmarks/results/tbo.json", help="the per-rank results as JSON")
    p.add_argument("--trace", help="a folder for rank 0's Chrome trace of one tbo-2streams step")
    args = p.parse_args(argv)
    if args.requests % 2:
        p.error("--requests must be even")
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    spec = dict(
        model=args.model, hf_config=model_hf_config(args), dtype=args.dtype, device=args.device, reduction="ar",
        requests=args.requests, tokens_per_request=args.tokens_per_request, warmup=args.warmup, iters=args.iters,
        seed=args.seed, trace=args.trace,
    )
    from layer_boundary import Parallel, Topology

    if args.gpus == 1:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        results = [measure_rank(Parallel.single(), spec)]
    else:
        from layer_boundary.testing import ProcessWorld

        world = ProcessWorld(args.gpus, device=args.device, timeout=1800, collective_timeout=600)
        args.placement = world.placement.describe()
        if world.note:
            print(world.note, flush=True)
        try:
            results = world.run(measure_rank, Topology(tp=args.gpus), spec)
        finally:
            world.close()
    worst = report(args, results)
    tolerance = CHECK_TOLERANCE[args.dtype]
    if not worst <= tolerance:
        print(f"FAIL: TBO logits differ from the whole batch by {worst:.2e} (tolerance {tolerance:.0e})")
        return 1
    return 0


#: TBO against the whole batch: relative logit difference allowed per dtype (the order of the
#: microbatches' sums can round differently; anything TBO gets wrong is far larger)
CHECK_TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}


def report(args, results) -> float:
    # every rank waits for the others in each step's collectives: a step takes its slowest rank
    step = {mode: max(r["timings"][mode]["step_ms"] for r in results) for mode in MODES}
    launch = {mode: max(r["timings"][mode]["launch_ms"] for r in results) for mode in MODES}
    serial_sum = step["half0"] + step["half1"]
    tokens = args.requests * args.tokens_per_request
    print(
        f"TBO overlap: {args.model} hidden {args.hidden}, {args.layers} layers, TP={args.gpus} ({args.device}), {args.dtype}, "
        f"{args.requests} requests x {args.tokens_per_request} tokens = {tokens} tokens, median of {args.iters}"
    )
    worst = max(max(r["checks"].values()) for r in results)
    print(f"check: TBO logits vs the whole batch, max relative difference {worst:.2e}")
    print(f"{'mode':<14}{'step ms':>10}{'host ms':>10}{'vs serial sum':>15}")
    for mode in MODES:
        print(f"{mode:<14}{step[mode]:>10.3f}{launch[mode]:>10.3f}{(step[mode] / serial_sum - 1) * 100:>+14.1f}%")
    print(f"{'serial sum':<14}{serial_sum:>10.3f}")
    saved = (serial_sum - step["tbo-2streams"]) / serial_sum * 100
    verdict = "overlap visible" if step["tbo-2streams"] < min(serial_sum, step["tbo-1stream"]) else "no overlap visible"
    if args.device != "cuda":
        verdict = "a CPU dry run: these timings say nothing about overlap"
    elif "correctness only" in (getattr(args, "placement", "") or ""):
        verdict = "ranks share a GPU: these timings say nothing about overlap"
    print(f"tbo-2streams vs serial sum: {saved:+.1f}% of the serial sum saved; vs tbo-1stream: "
          f"{(step['tbo-1stream'] - step['tbo-2streams']) / step['tbo-1stream'] * 100:+.1f}% -> {verdict}")
    traces = [r["trace"] for r in results if r.get("trace")]
    if traces:
        print(f"trace: {traces[0]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "step_ms": step, "launch_ms": launch, "serial_sum_ms": serial_sum,
                                              "check_max_rel_diff": worst, "results": results}, indent=2))
    return worst


if __name__ == "__main__":
    sys.exit(main())
