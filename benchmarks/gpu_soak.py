#!/usr/bin/env python3
"""GPU soak: many decode steps through the boundaries with the flashinfer plugin, watching for
growth, then a rank killed in the middle of a forward.

1. Soak. A Qwen3 of realistic width (bf16) on `--tp` ranks with every installed plugin prepared
   (`prepare_model`: the flashinfer workspaces on a GPU), a static KV cache of `--slots`
   requests; every `--window` decode steps the requests start over (a fresh prefill into the
   same slots), so a step's memory must not depend on how many steps ran. Every
   `--sample-every` steps each rank records GPU memory (`torch.cuda.memory_allocated`,
   `memory_reserved`), live tensors, live CUDA streams and live boundary objects (residual
   streams, contributions, owed outputs, forwards), all counted through gc after a sync. The
   first sample is taken after one whole window (warm-up); growth = last sample - first.
2. A rank killed mid-forward. A fresh world runs a few decode steps; at `--kill-step` the last
   rank SIGKILLs itself when it enters its middle layer, while the others are on their way
   into that layer's collective. The launcher must report a clear error naming the dead rank
   within `--kill-deadline` seconds (the survivors raising, or torn down), never hang.

Ranks are launched by `layer_boundary.launch.ProcessWorld`: one GPU a rank with NCCL where
there are enough GPUs, else the ranks share the GPU (gloo with CUDA tensors, the shared-device
world). `--device cpu` runs the same code on gloo CPU ranks with the embedded tiny Qwen3 (the
test suite runs it that way, so the script cannot rot).

    python benchmarks/gpu_soak.py                          # 10,000 steps, TP=2, on the GPU(s)
    python benchmarks/gpu_soak.py --steps 2000 --tp 2 --json
    python benchmarks/gpu_soak.py --device cpu --steps 40  # the CPU mode

Prints a summary (or `--json`) and writes the JSON to `--out`; exits 1 when memory, tensors,
streams or boundary objects grew beyond the limits or the kill check failed.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

#: the realistic-width Qwen3 of the GPU soak (hidden 2048, GQA 16/4 heads of 128)
GPU_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _tracked():
    from layer_boundary import Contribution, Forward, OwedOutput, ResidualStream

    return {"residual_streams": ResidualStream, "contributions": Contribution, "owed_outputs": OwedOutput, "forwards": Forward}


def sample(step: int, on_gpu: bool) -> dict:
    """What is alive on this rank now (after a device sync and a full gc)."""
    if on_gpu:
        torch.cuda.synchronize()
    gc.collect()
    tracked = _tracked()
    counts = {name: 0 for name in tracked}
    tensors = streams = 0
    with warnings.catch_warnings():  # isinstance() reads __class__, which warns on torch's deprecated aliases
        warnings.simplefilter("ignore")
        objects = [(obj, type(obj)) for obj in gc.get_objects()]
    for obj, kind_of in objects:
        if issubclass(kind_of, torch.Tensor):
            tensors += 1
        elif on_gpu and issubclass(kind_of, torch.cuda.Stream):
            streams += 1
        else:
            for name, kind in tracked.items():
                if issubclass(kind_of, kind):
                    counts[name] += 1
    out = {"step": step, "tensors": tensors, "streams": streams if on_gpu else None, **counts}
    out["allocated"] = torch.cuda.memory_allocated() if on_gpu else None
    out["reserved"] = torch.cuda.memory_reserved() if on_gpu else None
    return out


def _build(parallel, job: dict):
    """The model on this rank with random weights, every plugin prepared, and its static cache."""
    from layer_boundary.models import build_model, family, model_config
    from layer_boundary.models.weights import open_source
    from layer_boundary import prepare_model

    on_gpu = job["device"] == "cuda"
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    dtype = getattr(torch, job["dtype"])
    config = model_config("qwen3", job["hf_config"])
    model = build_model(config, parallel, dtype=dtype, device=device)
    if on_gpu:  # drawn on the device: a host-drawn state dict of this width takes minutes
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    else:
        family("qwen3").load_weights(model, open_source(family("qwen3").random_weights(config, dtype, 0)))
    prepared = prepare_model(model, max_tokens=job["slots"] * job["prompt"])
    report = None
    try:  # what the flashinfer plugin decided, when it is installed (its own report)
        from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

        if on_gpu:
            report = str(prepare_flashinfer_fusion(model, max_tokens=job["slots"] * job["prompt"]))
    except ImportError:
        report = "layer-boundary-flashinfer is not installed"
    cache = model.new_static_cache(job["slots"], job["prompt"] + job["window"] + 1)
    return model, config, cache, device, {"setup": list(prepared), "flashinfer": report}


def _prompts(config, job, cycle: int):
    gen = torch.Generator().manual_seed(1000 + cycle)
    return [torch.randint(0, config.vocab_size, (job["prompt"],), generator=gen) for _ in range(job["slots"])]


@torch.inference_mode()
def soak_rank(parallel, job: dict) -> dict:
    from layer_boundary.collectives import CollectiveCounter, CountingCollectives
    from layer_boundary.models.decode import static_decode_step, static_prefill
    from layer_boundary.progress import progress
    from layer_boundary import release_model

    counter = CollectiveCounter()
    counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    model, config, cache, device, prepared = _build(counted, job)
    on_gpu = device.startswith("cuda")
    slots = torch.arange(job["slots"], device=device)
    gen = torch.Generator().manual_seed(7)
    samples, collectives = [], {}
    bar = progress(job["steps"], "  soak", enabled=job["progress"] and parallel.rank == 0)
    start = time.perf_counter()
    window = job["window"]
    for step in range(job["steps"]):
        if step % window == 0:  # the requests start over in the same slots
            static_prefill(model, counted, cache, _prompts(config, job, step // window), device)
        ids = torch.randint(0, config.vocab_size, (job["slots"],), generator=gen).to(device)
        positions = torch.full((job["slots"],), job["prompt"] + step % window, dtype=torch.long, device=device)
        counter.reset()
        static_decode_step(model, counted, cache, ids, slots, positions)
        if step == 0 or step == job["steps"] - 1:
            collectives["first" if step == 0 else "last"] = counter.snapshot()
        done = step + 1
        if done >= window and (done - window) % job["sample_every"] == 0:
            samples.append(sample(done, on_gpu))
        bar.update(1)
    bar.close()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    release_model(model)
    return {"rank": parallel.rank, "samples": samples, "collectives": collectives, "seconds": seconds, "prepared": prepared}


@torch.inference_mode()
def kill_rank(parallel, job: dict) -> dict:
    """Decode steps until `kill_step`; there the last rank kills itself entering its middle layer."""
    from layer_boundary.models.decode import static_decode_step, static_prefill

    model, config, cache, device, _ = _build(parallel, job)
    slots = torch.arange(job["slots"], device=device)
    victim = parallel.rank == parallel.topology.world_size - 1
    static_prefill(model, parallel, cache, _prompts(config, job, 0), device)
    for step in range(job["kill_step"] + 2):
        if victim and step == job["kill_step"]:
            middle = model.layers[len(model.layers) // 2]
            middle.register_forward_pre_hook(lambda module, args: os.kill(os.getpid(), signal.SIGKILL))
        ids = torch.zeros(job["slots"], dtype=torch.long, device=device)
        positions = torch.full((job["slots"],), job["prompt"] + step, dtype=torch.long, device=device)
        static_decode_step(model, parallel, cache, ids, slots, positions)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return {"rank": parallel.rank, "finished": True}  # only if nobody died: the check fails


def growth(samples: list) -> dict:
    first, last = samples[0], samples[-1]
    return {k: (None if first[k] is None else last[k] - first[k]) for k in first if k != "step"}


def _world(args, timeout: float, collective_timeout: float):
    from layer_boundary.launch import ProcessWorld

    return ProcessWorld(args.tp, device=args.device, timeout=timeout, collective_timeout=collective_timeout)


def run_soak(args, job) -> dict:
    from layer_boundary import Topology

    world = _world(args, timeout=args.timeout, collective_timeout=min(args.timeout, 600.0))
    try:
        results = world.run(soak_rank, Topology(tp=args.tp), job)
        note = world.note
    finally:
        world.close()
    per_rank = []
    ok = True
    for res in sorted(results, key=lambda r: r["rank"]):
        g = growth(res["samples"])
        bad = [k for k, limit in LIMITS(args).items() if g.get(k) is not None and g[k] > limit]
        ok = ok and not bad
        per_rank.append({**res, "growth": g, "grew": bad, "steps_per_s": args.steps / res["seconds"]})
    return {"ok": ok, "note": note, "ranks": per_rank}


def LIMITS(args) -> dict:  # noqa: N802 - a table, computed from the options
    return {
        "allocated": args.max_growth_mib << 20,
        "reserved": args.max_reserved_growth_mib << 20,
        "tensors": args.max_tensor_growth,
        "streams": 0,
        "residual_streams": 0,
        "contributions": 0,
        "owed_outputs": 0,
        "forwards": 0,
    }


def run_kill(args, job) -> dict:
    from layer_boundary import Topology
    from layer_boundary.launch import RankError, RankTimeout

    world = _world(args, timeout=args.kill_deadline, collective_timeout=args.kill_deadline / 2)
    start = time.monotonic()
    outcome, message = "finished", ""
    try:
        world.run(kill_rank, Topology(tp=args.tp), job)
    except RankError as exc:
        outcome, message = "error", str(exc)
    except RankTimeout as exc:
        outcome, message = "timeout", str(exc)
    finally:
        world.close()
    took = time.monotonic() - start
    victim = args.tp - 1
    reports = _rank_reports(message)
    survivors = {}
    for rank in range(args.tp - 1):
        lines = [line.strip() for line in reports.get(rank, "").splitlines() if line.strip()]
        survivors[rank] = lines[-1] if lines else "no error of its own: still waiting when the world was torn down"
    named = reports.get(victim, "").startswith("died")
    raised = all(rank in reports for rank in range(args.tp - 1))
    return {
        "ok": outcome == "error" and named and raised and took < args.kill_deadline,
        "outcome": outcome,
        "seconds": round(took, 2),
        "victim": victim,
        "victim_reported_dead": named,
        "survivors_raised": raised,
        "survivors": survivors,
        "message_head": message.splitlines()[0] if message else "",
    }


def _rank_reports(message: str) -> dict:
    """A RankError's text split per rank: `rank N: died ...` or `rank N:` and a traceback."""
    import re

    parts = re.split(r"^rank (\d+):", message, flags=re.M)
    return {int(parts[i]): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


def _job(args) -> dict:
    on_gpu = args.device == "cuda"
    if on_gpu:
        hf = dict(GPU_CONFIG, num_hidden_layers=args.layers)
    else:
        from layer_boundary.models import family

        hf = dict(family("qwen3").preset)
    from layer_boundary.progress import wanted

    return {
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if on_gpu else "float32"),
        "hf_config": hf,
        "slots": args.slots,
        "prompt": args.prompt,
        "window": args.window,
        "steps": args.steps,
        "sample_every": args.sample_every,
        "kill_step": args.kill_step,
        "progress": wanted(sys.stderr, machine_output=args.json),
    }


def _parser():
    from layer_boundary.cli.args import OneLineParser, positive_float, positive_int

    ap = OneLineParser(prog="gpu_soak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=positive_int, default=10_000, help="decode steps (default 10,000)")
    ap.add_argument("--tp", type=positive_int, default=2, help="ranks (default 2; on one GPU they share it)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 (cuda), float32 (cpu)")
    ap.add_argument("--layers", type=positive_int, default=4, help="layers of the GPU model (hidden 2048)")
    ap.add_argument("--slots", type=positive_int, default=8, help="requests decoded together")
    ap.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens of each request")
    ap.add_argument("--window", type=positive_int, default=500, help="decode steps before the requests start over")
    ap.add_argument("--sample-every", type=positive_int, default=1000, help="steps between samples (after the first window)")
    ap.add_argument("--max-growth-mib", type=int, default=0, help="allowed growth of memory_allocated (MiB)")
    ap.add_argument("--max-reserved-growth-mib", type=int, default=64, help="allowed growth of memory_reserved (MiB)")
    ap.add_argument("--max-tensor-growth", type=int, default=0, help="allowed growth of live tensors")
    ap.add_argument("--kill-step", type=positive_int, default=3, help="the decode step the last rank dies in")
    ap.add_argument("--kill-deadline", type=positive_float, default=120.0, help="seconds within which the kill must be reported")
    ap.add_argument("--no-kill", action="store_true", help="skip the killed-rank check")
    ap.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds for the whole soak")
    ap.add_argument("--out", default="benchmarks/results/gpu_soak.json")
    ap.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_soak.py: error: no CUDA device is visible; run on a GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    if args.window >= args.steps or args.sample_every > args.steps - args.window:
        print(f"gpu_soak.py: error: --steps {args.steps} leaves no sample after the first --window {args.window} "
              f"(every --sample-every {args.sample_every}); raise --steps or lower the others", file=sys.stderr)
        return 2
    job = _job(args)
    result = {"options": {k: v for k, v in vars(args).items()}, "model": job["hf_config"], "dtype": job["dtype"]}
    if args.device == "cuda":
        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    result["soak"] = run_soak(args, job)
    result["kill"] = None if args.no_kill else run_kill(args, job)
    result["ok"] = result["soak"]["ok"] and (result["kill"] is None or result["kill"]["ok"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result, args)
    return 0 if result["ok"] else 1


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _print(result, args) -> None:
    soak = result["soak"]
    print(f"soak: {args.steps} decode steps, TP={args.tp}, {result['dtype']}, {args.device}: {'OK' if soak['ok'] else 'GREW'}")
    if soak["note"]:
        print(f"  {soak['note']}")
    for r in soak["ranks"]:
        first, last = r["samples"][0], r["samples"][-1]
        print(f"  rank {r['rank']}: {r['steps_per_s']:.1f} steps/s; step {first['step']} -> {last['step']}: "
              f"allocated {_mib(first['allocated'])} -> {_mib(last['allocated'])}, reserved {_mib(first['reserved'])} -> "
              f"{_mib(last['reserved'])}, tensors {first['tensors']} -> {last['tensors']}, streams {first['streams']} -> {last['streams']}"
              + (f"; grew: {', '.join(r['grew'])}" if r["grew"] else ""))
        print(f"    collectives per decode step: first {r['collectives'].get('first')}, last {r['collectives'].get('last')}")
    fi = soak["ranks"][0]["prepared"]["flashinfer"]
    if fi:
        print("  " + fi.replace("\n", "\n  "))
    kill = result["kill"]
    if kill is not None:
        print(f"kill: rank {kill['victim']} killed mid-forward: {'OK' if kill['ok'] else 'FAIL'} ({kill['outcome']} after {kill['seconds']} s)")
        for rank, line in kill["survivors"].items():
            print(f"  rank {rank}: {line}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
