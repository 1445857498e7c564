"""Where a captured decode step spends the time its kernels do not: `bench decode`'s qwen3 (hidden
4096, 8 layers, bf16, TP=1) captured per batch, replayed four ways (GPU; group `probe-replay` of
scripts/gpu_tests.sh).

- `synced_us`: the inputs copied in, one replay, waited for (what `bench decode` reports);
- `in_place_us`: one replay with the inputs already in the graph's buffers, waited for;
- `pipelined_us`: 20 replays back to back (the launch latency hides behind the step before);
- `host_launch_us`: the host time of the `graph.replay()` call alone (the GPU idle before it).

Beside them, measured after every timing (the profiler slows later graph launches), the
kernels' own time as the profiler sees a replay (`busy_us`) and the idle time between kernels
summed by the pair of kernels around it. With `--no-pdl` every step is also
captured with the cutedsl kernels launched without programmatic dependent launch, to see whether
dependents waiting on an SM slow the GEMMs they follow (the profiler serialises kernels, so its
kernel times cannot show that). JSON to --out.

    python3 benchmarks/replay_probe.py --batches 1 8 32 --no-pdl --out replay_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter

import torch

from layer_boundary.bench.decode import REALISTIC, _events_us, _random_init, host_launch_us, weight_floor


def _family(name: str) -> str:
    """A short kernel family name: enough to tell GEMMs, norms, attention and copies apart."""
    for key, short in (("nvjet", "gemm"), ("splitKreduce", "splitk_reduce"), ("AddRMSNorm", "add_rmsnorm"),
                       ("QKNormRope", "qk_norm_rope"), ("GatedActivation", "gated_act"), ("BatchDecode", "decode_attn"),
                       ("AppendPaged", "kv_append"), ("Memcpy", "memcpy"), ("Memset", "memset"), ("gather", "embed"),
                       ("indexSelect", "embed"), ("rmsnorm", "rmsnorm"), ("elementwise", "elementwise")):
        if key in name:
            return short
    return name[:40]


def _replay_timeline(replay) -> dict:
    """One replay under the profiler: busy time, idle time between kernels summed by the
    (previous, next) kernel families, and the kernel order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    gaps, busy = Counter(), 0.0
    for before, after in zip(kernels, kernels[1:]):
        gap = after.time_range.start - before.time_range.end
        gaps[f"{_family(before.name)} -> {_family(after.name)}"] += gap
    for e in kernels:
        busy += e.time_range.elapsed_us()
    return {
        "kernels": len(kernels),
        "busy_us": round(busy, 1),
        "span_us": round(kernels[-1].time_range.end - kernels[0].time_range.start, 1),
        "gaps_by_pair_us": {k: round(v, 2) for k, v in gaps.most_common()},
        "order": [_family(e.name) for e in kernels[:20]],
    }


@contextlib.contextmanager
def _cutedsl_pdl(enabled: bool):
    """The cutedsl kernels' `pdl` default switched for the captures inside (a diagnostic switch;
    the kernels take `pdl` per call and compile a variant per value)."""
    if enabled:
        yield
        return
    from layer_boundary_cutedsl.kernels import add_rmsnorm, gated_activation, qk_norm_rope

    functions = (add_rmsnorm.fused_add_rmsnorm, gated_activation.gated_activation, qk_norm_rope.fused_qk_norm_rope)
    saved = [dict(f.__kwdefaults__) for f in functions]
    for f in functions:
        f.__kwdefaults__["pdl"] = False
    try:
        yield
    finally:
        for f, old in zip(functions, saved):
            f.__kwdefaults__.clear()
            f.__kwdefaults__.update(old)


@torch.inference_mode()
def probe(batches, layers: int, prompt: int, repeats: int, pdl_modes) -> dict:
    from layer_boundary import Parallel, prepare_model
    from layer_boundary._cuda_graphs import CapturedStep
    from layer_boundary.models import build_model, model_config
    from layer_boundary.models.decode import static_decode_step, static_prefill

    parallel = Parallel.single()
    config = model_config("qwen3", dict(REALISTIC, num_hidden_layers=layers))
    model = build_model(config, parallel, dtype=torch.bfloat16, device="cuda")
    _random_init(model)
    prepare_model(model, max_tokens=max(batches) * prompt)
    _, floor_us = weight_floor(model)
    rows, steps, caches = [], [], []
    for batch in batches:
        cache = model.new_static_cache(batch, prompt + 8)
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, config.vocab_size, (prompt,), generator=gen) for _ in range(batch)]
        static_prefill(model, parallel, cache, prompts, "cuda")
        ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).cuda()
        pos = torch.full((batch,), prompt, dtype=torch.long, device="cuda")
        for pdl in pdl_modes:
            with _cutedsl_pdl(pdl):
                step = CapturedStep(lambda i, p, c=cache: static_decode_step(model, parallel, c, i, None, p), (ids.clone(), pos.clone()))
            row = dict(batch=batch, cutedsl_pdl=pdl, floor_us=floor_us)
            row["synced_us"] = _events_us(lambda s=step: s.replay(ids, pos), repeats)
            for static, given in zip(step.static_inputs, (ids, pos)):
                static.copy_(given)
            row["in_place_us"] = _events_us(step.graph.replay, repeats)
            row["pipelined_us"] = _events_us(step.graph.replay, max(3, repeats // 3), calls=20)
            row["host_launch_us"] = host_launch_us(step.graph, repeats)
            rows.append(row)
            steps.append(step)
            print(
                f"batch {batch:>3} pdl {str(pdl):>5}: synced {row['synced_us']:7.1f}  in place {row['in_place_us']:7.1f}  "
                f"pipelined {row['pipelined_us']:7.1f}  host launch {row['host_launch_us']:6.1f} us  "
                f"({row['synced_us'] / floor_us:.2f}x floor {floor_us:.0f})",
                flush=True,
            )
        caches.append(cache)
    # the profiles last: once torch.profiler has run, CUPTI stays attached and every later graph
    # launch costs the host more (see bench decode)
    for row, step in zip(rows, steps):
        row.update(_replay_timeline(step.graph.replay))
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(row["gaps_by_pair_us"].items())[:6])
        print(f"batch {row['batch']:>3} pdl {str(row['cutedsl_pdl']):>5}: busy {row['busy_us']:7.1f} us; idle between kernels: {top}", flush=True)
    return {"device": torch.cuda.get_device_name(), "layers": layers, "prompt": prompt, "floor_us": floor_us,
            "attention_kernels": str(getattr(model, "attention_kernels", None)), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--no-pdl", action="store_true", help="also capture with the cutedsl kernels launched without PDL")
    ap.add_argument("--out", default="replay_probe.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the replay probe needs a CUDA GPU")
    modes = (True, False) if args.no_pdl else (True,)
    result = probe(args.batches, args.layers, args.prompt, args.repeats, modes)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
