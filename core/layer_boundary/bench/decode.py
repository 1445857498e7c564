"""End-to-end decode step time of a model family at a realistic width (its record's `realistic()`
config; qwen3 by default, hidden 4096) through the boundaries on GPU:
eager vs CUDA-graph replay (graph checked equal to eager first), per batch size, with peak memory;
what one step launches (torch.profiler: kernel count and summed kernel time) for ours and for
Hugging Face transformers on the same config and GPU (sdpa attention, eager, its DynamicCache);
and the weight-streaming floor of a step: the bytes of every weight a decode step reads (all
parameters but the input embedding, of which it reads a row per token) over the rate this GPU
copies device to device, measured in the same run (about 4.3 TB/s on an H200). Targets: kernel
time <= 0.8x HF's, graph replay <= 1.5x the floor. The family's model needs `new_static_cache(slots, max_len)` (a cache
with `snapshot()` and `restore()`), driven by `DecodeLayout` steps.

TP=1 runs in this process on one GPU. TP>1 (fused vs unfused with the flashinfer plugin) needs as
many GPUs as ranks and runs under torchrun: `torchrun --nproc-per-node 2 -m layer_boundary bench
decode --tp 2`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .._options import OneLineParser, positive_int
from .._timing import cuda_event_us
from .._weights import mark_loaded



def _random_init(model) -> None:
    """Random weights drawn on the GPU (std 1/sqrt(fan_in); norms 1 + 0.1 N): a 1.8B-parameter
    model initialises in a second instead of drawing and copying it on the host."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    mark_loaded(model)  # every parameter written: the model's forward runs


def measured_stream_bytes_per_s(nbytes: int = 2**30, repeats: int = 20) -> float:
    """Bytes a second this GPU moves in a device-to-device copy of `nbytes` (read and written: 2 x
    nbytes), the faster of torch's copy and an elementwise kernel, median of `repeats` each: the
    floor is then of the machine the step ran on, not of the GPU the targets were set on."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    fastest = float("inf")
    for copy in (lambda: dst.copy_(src), lambda: torch.neg(src, out=dst)):
        copy()
        fastest = min(fastest, _events_us(copy, repeats))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (fastest * 1e-6)


def weight_floor(model, bytes_per_s: float) -> tuple[int, float]:
    """(bytes, microseconds at `bytes_per_s`) of the weights one decode step streams: every
    parameter except the input embedding."""
    embed = getattr(model, "embed_tokens", None)
    skip = {id(p) for p in embed.parameters()} if isinstance(embed, torch.nn.Module) else set()
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.nn.Module):
        skip -= {id(p) for p in lm_head.parameters()}  # tied: the head still streams it
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    return nbytes, nbytes / bytes_per_s * 1e6


def _add_norm_kernels(model) -> dict:
    """Which add + norm each RMSNorm of the model runs (name -> how many norms)."""
    from .._residual.add_norm import RMSNorm

    out: dict = {}
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.__dict__.get("_add_norm_choices"):
            name = module.add_norm_kernel()
            out[name] = out.get(name, 0) + 1
        for choice in (module.__dict__.get("_norm_choices") or {}).values():  # norms run without an add
            name = f"{choice.name} (no add)"
            out[name] = out.get(name, 0) + 1
    return out


def _hf_model(cfg: dict):
    import transformers

    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(torch.bfloat16).eval()


@torch.inference_mode()
def hf_profile(hf, batches, prompt: int, vocab: int) -> dict:
    """Per batch: what one Hugging Face decode step launches (after a prefill of `prompt` tokens),
    the cache passed and read back the way the installed release names it."""
    from ..cli.oracle import cache_keyword, returned_cache
    from .profile import profile_step

    keyword = cache_keyword(hf)
    out = {}
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, prompt), generator=gen).cuda()
        past = returned_cache(hf(input_ids=ids, use_cache=True))
        step_ids = torch.randint(0, vocab, (batch, 1), generator=gen).cuda()
        out[batch] = profile_step(lambda: hf(input_ids=step_ids, use_cache=True, **{keyword: past}).logits)
        del past
    return out


def _events_us(fn, repeats: int, calls: int = 1) -> float:
    """Microseconds per call between a pair of CUDA events around `calls` back-to-back calls
    (median of `repeats`). One call: each call waited for; more: the steady state of an engine
    that enqueues the next step without waiting, where a graph's launch latency hides behind the
    step before."""
    return statistics.median(cuda_event_us(fn, calls) for _ in range(repeats))


def host_launch_us(graph, repeats: int) -> float:
    """Host microseconds of one `graph.replay()` call with the GPU idle (median of `repeats`):
    what a synced replay waits before its first kernel can start."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


@torch.inference_mode()
def realistic_config(item, layers: int) -> dict:
    """The family's real-width config with `layers` layers (refused, one line, without one)."""
    from ..cli.usage import UsageError

    if item.record.realistic is None:
        raise UsageError(f"bench decode: model family {item.record.model!r} names no realistic config (ModelFamily.realistic)")
    return dict(item.record.realistic(), num_hidden_layers=layers)


def run(batches, layers: int, prompt: int, repeats: int, parallel=None, hf: bool = True, model_name: str = "qwen3") -> dict:
    from .._cuda_graphs import CapturedStep
    from .._lifecycle import prepare_model
    from .._parallel import Parallel
    from ..cli.families import build, family_config, find_family
    from ..cli.static_decode import static_decode_step, static_prefill
    from .profile import profile_step

    parallel = parallel or Parallel.single()
    item = find_family(model_name)
    cfg = realistic_config(item, layers)
    config = family_config(item, cfg)
    model = build(item, config, parallel, dtype=torch.bfloat16, device="cuda")
    if not hasattr(model, "new_static_cache"):
        from ..cli.usage import UsageError

        raise UsageError(f"bench decode: the {model_name} model has no new_static_cache(slots, max_len) (see docs/models.md)")
    _random_init(model)

    # the engine's life cycle: the norms' and the attention's kernels chosen before any capture
    prepare_model(model, max_tokens=max(batches) * prompt)
    chosen = getattr(model, "attention_kernels", None)
    attention = None
    if chosen is not None:
        attention = {"rope": chosen.rope.name, "decode_attention": chosen.decode_attention.name, "qk_norm_rope": chosen.qk_norm_rope.name}
    # the gated MLPs' act(gate) * up kernel (one per distinct MLP width; qwen3 has one)
    mlp_kernels = getattr(model, "mlp_kernels", None)
    gated = ", ".join(sorted({c.name for c in mlp_kernels.values()})) if mlp_kernels else None
    stream_bytes_per_s = measured_stream_bytes_per_s()
    weight_bytes, floor_us = weight_floor(model, stream_bytes_per_s)
    # every timing first, every profile after: once torch.profiler has run in a process, CUPTI
    # stays attached and each later graph launch costs the host ~50 us more (measured on the
    # H200: 12 us before, 62-83 us after), which a synced replay pays in full
    steps, rows = [], []
    for batch in batches:
        cache = model.new_static_cache(batch, prompt + 8)
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, config.vocab_size, (prompt,), generator=gen) for _ in range(batch)]
        slots = None  # row i is cache slot i: the cache is read in place (an engine with a slot table passes it)
        ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).cuda()
        pos = torch.full((batch,), prompt, dtype=torch.long, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        graph = CapturedStep(lambda i, p, c=cache: static_decode_step(model, parallel, c, i, slots, p), (ids.clone(), pos.clone()))
        static_prefill(model, parallel, cache, prompts, "cuda")
        snap = cache.snapshot()
        eager_out = static_decode_step(model, parallel, cache, ids, slots, pos).clone()
        cache.restore(snap)
        replay_out = graph.replay(ids, pos).clone()
        equal = bool(torch.equal(eager_out, replay_out))
        eager_us = _events_us(lambda c=cache, i=ids, p=pos: static_decode_step(model, parallel, c, i, slots, p), repeats)
        graph_us = _events_us(lambda g=graph, i=ids, p=pos: g.replay(i, p), repeats * 3)
        graph_pipelined_us = _events_us(lambda g=graph, i=ids, p=pos: g.replay(i, p), repeats, calls=20)
        # an engine whose sampler writes the next ids (and positions) into the graph's own input
        # buffers: the replay copies nothing first
        for static, given in zip(graph.static_inputs, (ids, pos)):
            static.copy_(given)
        graph_in_place_us = _events_us(lambda g=graph: g.replay(*g.static_inputs), repeats * 3)
        launch_us = host_launch_us(graph.graph, repeats * 3)
        steps.append((cache, graph, ids, pos))
        rows.append(
            {
                "batch": batch,
                "eager_us": eager_us,
                "graph_us": graph_us,
                "eager_over_graph": eager_us / graph_us,
                "graph_equals_eager": equal,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                "floor_us": floor_us,
                "graph_over_floor": graph_us / floor_us,
                "graph_pipelined_us": graph_pipelined_us,
                "graph_in_place_us": graph_in_place_us,
                "graph_in_place_over_floor": graph_in_place_us / floor_us,
                "graph_pipelined_over_floor": graph_pipelined_us / floor_us,
                "graph_launch_host_us": launch_us,
            }
        )
    for row, (cache, graph, ids, pos) in zip(rows, steps):
        ours = profile_step(lambda c=cache, i=ids, p=pos: static_decode_step(model, parallel, c, i, slots, p))
        # the replay's kernels as the profiler sees them inside the graph (their times are what
        # graph replay pays; the eager profile's times are of kernels launched one by one)
        replayed = profile_step(lambda g=graph, i=ids, p=pos: g.replay(i, p))
        row.update(
            kernels=ours["kernels"],
            kernel_us=ours["kernel_us"],
            copies=ours["copies"],
            by_name=ours["by_name"],
            by_time=ours["by_time"],
            graph_kernels=replayed["kernels"],
            graph_kernel_us=replayed["kernel_us"],
            graph_by_time=replayed["by_time"],
            graph_timeline=replayed["timeline"],
        )
    del steps
    add_norm = _add_norm_kernels(model)
    if hf and parallel.topology.tp == 1:
        del model
        torch.cuda.empty_cache()
        hf_model = _hf_model(cfg)
        for row, (batch, theirs) in zip(rows, hf_profile(hf_model, batches, prompt, config.vocab_size).items()):
            row.update(hf_kernels=theirs["kernels"], hf_kernel_us=theirs["kernel_us"], hf_copies=theirs["copies"],
                       hf_by_name=theirs["by_name"], hf_by_time=theirs["by_time"], kernel_us_over_hf=row["kernel_us"] / theirs["kernel_us"])
        del hf_model
    return {"family": model_name, "model": cfg, "tp": parallel.topology.tp, "prompt": prompt, "rows": rows, "device": torch.cuda.get_device_name(),
            "weight_bytes": weight_bytes, "floor_us": floor_us, "stream_bytes_per_s": stream_bytes_per_s,
            "add_norm_kernels": add_norm, "attention_kernels": attention, "gated_activation_kernel": gated, "hf": "transformers, sdpa, eager, DynamicCache" if hf and parallel.topology.tp == 1 else None,
            "targets": {"kernel_us_over_hf": 0.8, "graph_over_floor": 1.5}}


def main(argv=None) -> dict:
    ap = OneLineParser(prog=f"layer-boundary bench {Path(__file__).stem}", description=__doc__)
    ap.add_argument("--model", default="qwen3", help="a registered model family with a realistic config (default qwen3)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 32])
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--prompt", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=30)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers profile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench decode needs a CUDA GPU")
    result = run(args.batches, args.layers, args.prompt, args.repeats, hf=not args.no_hf, model_name=args.model)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"decode step, {args.model} hidden {result['model']['hidden_size']} x {args.layers} layers, bf16, TP={result['tp']}, {result['device']}")
    print(f"{'batch':>6} {'eager us':>10} {'graph us':>10} {'eager/graph':>12} {'graph==eager':>13} {'peak GiB':>9}")
    for r in result["rows"]:
        print(f"{r['batch']:>6} {r['eager_us']:>10.1f} {r['graph_us']:>10.1f} {r['eager_over_graph']:>12.2f} {str(r['graph_equals_eager']):>13} {r['peak_mem_gib']:>9.2f}")
    print(f"\none step under torch.profiler; weight-streaming floor {result['floor_us']:.0f} us "
          f"({result['weight_bytes'] / 1e9:.2f} GB at {result['stream_bytes_per_s'] / 1e12:.1f} TB/s); add + norm: {result['add_norm_kernels']}; "
          f"attention: {result['attention_kernels']}; gated activation: {result['gated_activation_kernel']}")
    print(f"{'batch':>6} {'kernels':>8} {'kernel us':>10} {'HF kernels':>11} {'HF kernel us':>13} {'ours/HF':>8} {'graph/floor':>12}")
    for r in result["rows"]:
        hf_k = r.get("hf_kernels", "-")
        hf_us = f"{r['hf_kernel_us']:.1f}" if "hf_kernel_us" in r else "-"
        ratio = f"{r['kernel_us_over_hf']:.2f}" if "kernel_us_over_hf" in r else "-"
        print(f"{r['batch']:>6} {r['kernels']:>8} {r['kernel_us']:>10.1f} {hf_k:>11} {hf_us:>13} {ratio:>8} {r['graph_over_floor']:>12.2f}")
    for r in result["rows"]:
        print(f"\nbatch {r['batch']}: where graph replay's time goes ({r['graph_kernels']} kernels, {r['graph_kernel_us']:.1f} us)")
        for name, launches, us in r["graph_by_time"]:
            print(f"  {us:>8.1f} us {launches:>4}x  {name}")
        t = r["graph_timeline"]
        print(f"  on the device: span {t['span_us']:.1f} us, busy {t['busy_us']:.1f}, idle {t['idle_us']:.1f}; "
              f"20 replays back to back: {r['graph_pipelined_us']:.1f} us a step ({r['graph_pipelined_over_floor']:.2f}x the floor); "
              f"one replay with its inputs already in place: {r['graph_in_place_us']:.1f} us ({r['graph_in_place_over_floor']:.2f}x); "
              f"the host's graph launch call {r['graph_launch_host_us']:.1f} us")
        for before, after, us in t["gaps"]:
            print(f"  gap {us:>7.2f} us  {before} -> {after}")
    from .._timing import line_plot

    xs = [r["batch"] for r in result["rows"]]
    print(line_plot(str(Path(args.out).with_suffix(".png")), "decode step (TP=%d)" % result["tp"], "batch", "us",
                    {"eager": (xs, [r["eager_us"] for r in result["rows"]]), "graph replay": (xs, [r["graph_us"] for r in result["rows"]])}))
    return result


if __name__ == "__main__":
    main()
