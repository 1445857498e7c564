#!/usr/bin/env python3
"""GPU soak: many decode steps through the boundaries with the flashinfer plugin, watching for
growth, then a rank killed in the middle of a forward.

1. Soak. A Qwen3 on `--tp` ranks with every installed plugin prepared (`prepare_model`: the
   flashinfer workspaces on a GPU), a static KV cache of `--slots` requests; every `--window`
   decode steps the requests start over (a fresh prefill into the same slots), so a step's memory
   must not depend on how many steps ran. Each rank records GPU memory
   (`torch.cuda.memory_allocated`, `memory_reserved`, and the driver's used memory of the device,
   `torch.cuda.mem_get_info`), live tensors, live CUDA streams and live boundary objects
   (residual streams, contributions, owed outputs, forwards), counted through gc after a sync:
   before the first step, after one whole window (warm-up) and every `--sample-every` steps from
   there, and once more after `release_model`. Growth = last sample - the one after warm-up.
   The model is the embedded tiny preset (hidden 64; `--size wide`: hidden 2048), so a step is a
   handful of fused calls: ranks sharing one GPU time-slice, and a fused call there costs ~2 ms.
   On a GPU the sums the boundaries leave unfused (the terminal FFN's) run on FlashInfer's
   all-reduce too (`flashinfer_collectives`; `--collectives process-group` keeps them on the
   process group), and the soak fails when the fusion did not bind (`--allow-unfused`).
   `--budget-s` stops the soak early (at a sample, agreed by every rank) and reports the steps
   that ran and the rate, so a slow machine still ends inside its time limit.
2. A rank killed mid-forward. A fresh world runs a few decode steps; at `--kill-step` the last
   rank SIGKILLs itself when it enters its middle layer, while the others are on their way into
   that layer's collective. On the GPU the survivors' fused kernels wait for the dead peer
   forever, so each survivor waits for its step with a deadline (`--step-deadline`) and raises a
   clear error; the launcher must report the dead rank and the survivors' errors within
   `--kill-deadline` seconds of the death, and no rank process may be left, never a hang.

Ranks are launched by `layer_boundary.launch.ProcessWorld(device=...)`: one GPU a rank with NCCL
where there are enough GPUs, else the ranks share the GPU (gloo with CUDA tensors, the
shared-device world). `--device cpu` runs the same code on gloo CPU ranks (the test suite runs it
that way, so the script cannot rot).

    python benchmarks/gpu_soak.py                          # 10,000 steps, TP=2, on the GPU(s)
    python benchmarks/gpu_soak.py --only soak --budget-s 300 --json
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

#: `--size wide`: a Qwen3 of realistic width (hidden 2048, GQA 16/4 heads of 128)
WIDE_CONFIG = {
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
    del objects
    out = {"step": step, "tensors": tensors, "streams": streams if on_gpu else None, **counts}
    out["allocated"] = torch.cuda.memory_allocated() if on_gpu else None
    out["reserved"] = torch.cuda.memory_reserved() if on_gpu else None
    if on_gpu:  # the driver's view of the whole device (every rank sharing it, every allocator)
        free, total = torch.cuda.mem_get_info()
        out["device_used"] = total - free
    else:
        out["device_used"] = None
    return out


def _build(parallel, job: dict):
    """The model on this rank with random weights, every plugin prepared, and its static cache."""
    from layer_boundary_models import build_model, family, model_config
    from layer_boundary.cli.sources import open_source
    from layer_boundary import prepare_model

    on_gpu = job["device"] == "cuda"
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    dtype = getattr(torch, job["dtype"])
    config = model_config("qwen3", job["hf_config"])
    model = build_model(config, parallel, dtype=dtype, device=device)
    if job["hf_config"]["hidden_size"] > 256:  # drawn on the device: a host-drawn state dict of this width takes minutes
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    else:
        family("qwen3").load_weights(model, open_source(family("qwen3").random_weights(config, dtype, 0)))
    prepared = prepare_model(model, max_tokens=job["slots"] * job["prompt"])
    report, fused, bound = None, False, []
    try:  # what the flashinfer plugin decided, when it is installed (its own report; the workspaces are reused)
        from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

        if on_gpu:
            decided = prepare_flashinfer_fusion(model, max_tokens=job["slots"] * job["prompt"])
            report, fused, bound = str(decided), decided.available and bool(decided.bound), list(decided.collectives)
    except ImportError:
        report = "layer-boundary-flashinfer is not installed"
    cache = model.new_static_cache(job["slots"], job["prompt"] + job["window"] + 1)
    return model, config, cache, device, {"setup": list(prepared), "flashinfer": report, "fused": fused, "collectives_on_workspace": bound}


def _model_parallel(parallel, job: dict):
    """On a GPU, every sum the boundaries leave unfused (the terminal FFN's) on FlashInfer's
    all-reduce too: a process-group sum of ranks sharing a GPU copies through the host, a host
    sync in every step (and, with a dead peer, a wait no deadline can bound)."""
    if job["device"] != "cuda" or job["collectives"] != "flashinfer":
        return parallel, []
    try:
        from layer_boundary_flashinfer.collectives import flashinfer_collectives, wrapped_flashinfer_collectives
    except ImportError:
        return parallel, []
    wrapped = flashinfer_collectives(parallel)
    return wrapped, wrapped_flashinfer_collectives(wrapped.groups.values())


def _prompts(config, job, cycle: int):
    gen = torch.Generator().manual_seed(1000 + cycle)
    return [torch.randint(0, config.vocab_size, (job["prompt"],), generator=gen) for _ in range(job["slots"])]


def _say(parallel, line: str) -> None:
    if parallel.rank == 0:
        print(line, file=sys.stderr, flush=True)


def _line(s: dict) -> str:
    return (f"allocated {_mib(s['allocated'])}, reserved {_mib(s['reserved'])}, device used {_mib(s['device_used'])}, "
            f"tensors {s['tensors']}, streams {s['streams']}")


@torch.inference_mode()
def soak_rank(parallel, job: dict) -> dict:
    from layer_boundary.collectives import CollectiveCounter, CountingCollectives
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill
    from layer_boundary.cli.progress import progress
    from layer_boundary import release_model

    counter = CollectiveCounter()
    counted, workspace_sums = _model_parallel(parallel.with_groups(lambda g: CountingCollectives(g, counter)), job)
    model, config, cache, device, prepared = _build(counted, job)
    on_gpu = device.startswith("cuda")
    slots = torch.arange(job["slots"], device=device)
    gen = torch.Generator().manual_seed(7)
    before = sample(0, on_gpu)
    _say(parallel, f"soak: before the first step: {_line(before)}")
    samples, collectives = [], {}
    bar_on = job["progress"] and parallel.rank == 0
    bar = progress(job["steps"], "  soak", enabled=bar_on)
    start = time.perf_counter()
    window, budget = job["window"], job["budget_s"]
    done = 0
    stopped_early = False
    for step in range(job["steps"]):
        if step % window == 0:  # the requests start over in the same slots
            static_prefill(model, counted, cache, _prompts(config, job, step // window), device)
        ids = torch.randint(0, config.vocab_size, (job["slots"],), generator=gen).to(device)
        positions = torch.full((job["slots"],), job["prompt"] + step % window, dtype=torch.long, device=device)
        counter.reset()
        kernel_calls = sum(w.kernel_calls for w in workspace_sums)
        static_decode_step(model, counted, cache, ids, slots, positions)
        on_workspace = {"workspace_all_reduce": sum(w.kernel_calls for w in workspace_sums) - kernel_calls} if workspace_sums else {}
        if step == 0 or step == job["steps"] - 1:
            collectives["first" if step == 0 else "last"] = dict(counter.snapshot(), **on_workspace)
        done = step + 1
        bar.update(1)
        if done >= window and (done - window) % job["sample_every"] == 0:
            samples.append(sample(done, on_gpu))
            elapsed = time.perf_counter() - start
            if not bar_on:  # a line a sample instead (logs)
                _say(parallel, f"soak: step {done}/{job['steps']}, {done / elapsed:.1f} steps/s, {_line(samples[-1])}")
            # every rank stops at the same step (one tiny agreement per sample, uncounted)
            if budget and done < job["steps"] and not parallel.groups["tp"].agree(elapsed < budget):
                stopped_early = True
                break
    bar.close()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if stopped_early:  # the step before the sample that stopped the soak
        collectives["last"] = dict(counter.snapshot(), **on_workspace)
        _say(parallel, f"soak: --budget-s {budget:g} reached: stopped after {done} of {job['steps']} steps "
                       f"({done / seconds:.1f} steps/s)")
    release_model(model)
    del model, cache
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    after = sample(done, on_gpu)
    return {"rank": parallel.rank, "steps_done": done, "stopped_early": stopped_early, "before": before, "samples": samples,
            "after_release": after, "collectives": collectives, "seconds": seconds, "prepared": prepared}


def _bounded_sync(device: str, deadline: float, rank: int, step: int) -> None:
    """Wait for this rank's GPU work, at most `deadline` seconds: a fused kernel whose peer died
    spins forever, and a plain synchronize would never return."""
    if not device.startswith("cuda"):
        return
    done = torch.cuda.Event()
    done.record()
    end = time.monotonic() + deadline
    while not done.query():
        if time.monotonic() > end:
            raise RuntimeError(
                f"rank {rank}: decode step {step} did not finish on {device} within {deadline:g} s: a peer stopped taking "
                "part in the step's collectives (killed?), and this rank's kernels still wait for it"
            )
        time.sleep(0.005)


@torch.inference_mode()
def kill_rank(parallel, job: dict) -> dict:
    """Decode steps until `kill_step`; there the last rank kills itself entering its middle layer."""
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill

    parallel, _ = _model_parallel(parallel, job)
    model, config, cache, device, _ = _build(parallel, job)
    slots = torch.arange(job["slots"], device=device)
    victim = parallel.rank == parallel.topology.world_size - 1
    static_prefill(model, parallel, cache, _prompts(config, job, 0), device)
    _bounded_sync(device, 60.0, parallel.rank, -1)
    for step in range(job["kill_step"] + 2):
        if victim and step == job["kill_step"]:
            middle = model.layers[len(model.layers) // 2]

            def die(module, args):
                Path(job["death_file"]).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            middle.register_forward_pre_hook(die)
        ids = torch.zeros(job["slots"], dtype=torch.long, device=device)
        positions = torch.full((job["slots"],), job["prompt"] + step, dtype=torch.long, device=device)
        static_decode_step(model, parallel, cache, ids, slots, positions)
        _bounded_sync(device, job["step_deadline"], parallel.rank, step)
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
        per_rank.append({**res, "growth": g, "grew": bad, "steps_per_s": res["steps_done"] / res["seconds"]})
    steps = min(r["steps_done"] for r in per_rank)
    fused = all(r["prepared"]["fused"] for r in per_rank)
    if args.device == "cuda" and not args.allow_unfused:
        ok = ok and fused  # a soak "with the flashinfer plugin" that ran unfused measured something else
    return {"ok": ok, "fused": fused, "steps": steps, "complete": steps == args.steps, "note": note, "ranks": per_rank}


def LIMITS(args) -> dict:  # noqa: N802 - a table, computed from the options
    return {
        "allocated": args.max_growth_mib << 20,
        "reserved": args.max_reserved_growth_mib << 20,
        "device_used": args.max_reserved_growth_mib << 20,
        "tensors": args.max_tensor_growth,
        "streams": 0,
        "residual_streams": 0,
        "contributions": 0,
        "owed_outputs": 0,
        "forwards": 0,
    }


def run_kill(args, job) -> dict:
    import tempfile

    from layer_boundary import Topology
    from layer_boundary.launch import RankError, RankTimeout

    death_file = Path(tempfile.mkdtemp(prefix="gpu_soak_kill_")) / "died_at"
    job = dict(job, death_file=str(death_file))
    # a long process-group timeout: a rank may load FlashInfer's JIT module while the other waits in the
    # workspace's agreement; the survivors' own errors come from their step deadline (GPU) or a closed socket
    world = _world(args, timeout=args.kill_deadline + 120.0, collective_timeout=300.0)
    outcome, message = "finished", ""
    procs = []
    try:
        world.start()  # spawning and the process group are not what is timed
        procs = list(world._procs)
        start = time.monotonic()
        world.run(kill_rank, Topology(tp=args.tp), job)
    except RankError as exc:
        outcome, message = "error", str(exc)
    except RankTimeout as exc:
        outcome, message = "timeout", str(exc)
    finally:
        ended = time.time()
        world.close()
    took = time.monotonic() - start if procs else None
    died_at = float(death_file.read_text()) if death_file.is_file() else None
    after_death = None if died_at is None else round(ended - died_at, 2)
    left = [p.pid for p in procs if p.is_alive()]
    victim = args.tp - 1
    reports = _rank_reports(message)
    survivors = {}
    for rank in range(args.tp - 1):
        lines = [line.strip() for line in reports.get(rank, "").splitlines() if line.strip()]
        survivors[rank] = lines[-1] if lines else "no error of its own: still waiting when the world was torn down"
    named = reports.get(victim, "").startswith("died")
    raised = all(rank in reports for rank in range(args.tp - 1))
    in_time = after_death is not None and after_death < args.kill_deadline
    return {
        "ok": outcome == "error" and named and raised and in_time and not left,
        "outcome": outcome,
        "seconds": None if took is None else round(took, 2),
        "seconds_from_death_to_error": after_death,
        "victim": victim,
        "victim_reported_dead": named,
        "survivors_raised": raised,
        "survivors": survivors,
        "processes_left": left,
        "message_head": message.splitlines()[0] if message else "",
    }


def _rank_reports(message: str) -> dict:
    """A RankError's text split per rank: `rank N: died ...` or `rank N:` and a traceback."""
    import re

    parts = re.split(r"^rank (\d+):", message, flags=re.M)
    return {int(parts[i]): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


def _job(args) -> dict:
    on_gpu = args.device == "cuda"
    if args.size == "wide":
        hf = dict(WIDE_CONFIG)
    else:
        from layer_boundary_models import family

        hf = family("qwen3").preset()
    layers = args.layers or (2 if on_gpu and args.size == "tiny" else hf["num_hidden_layers"])
    hf["num_hidden_layers"] = layers
    from layer_boundary.cli.progress import wanted

    return {
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if on_gpu else "float32"),
        "hf_config": hf,
        "slots": args.slots,
        "prompt": args.prompt,
        "window": args.window,
        "steps": args.steps,
        "sample_every": args.sample_every,
        "budget_s": args.budget_s,
        "kill_step": args.kill_step,
        "step_deadline": args.step_deadline,
        "collectives": args.collectives,
        "progress": wanted(sys.stderr, machine_output=args.json),
    }


def _parser():
    from layer_boundary._options import OneLineParser, positive_float, positive_int

    ap = OneLineParser(prog="gpu_soak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=positive_int, default=10_000, help="decode steps (default 10,000)")
    ap.add_argument("--tp", type=positive_int, default=2, help="ranks (default 2; on one GPU they share it)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 (cuda), float32 (cpu)")
    ap.add_argument("--size", choices=["tiny", "wide"], default="tiny",
                    help="the model: the embedded Qwen3 preset (hidden 64, default) or hidden 2048")
    ap.add_argument("--layers", type=positive_int, help="layers (default 2 for the tiny model on a GPU, else the preset's 4)")
    ap.add_argument("--slots", type=positive_int, default=8, help="requests decoded together")
    ap.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens of each request")
    ap.add_argument("--window", type=positive_int, default=500, help="decode steps before the requests start over")
    ap.add_argument("--sample-every", type=positive_int, default=1000, help="steps between samples (after the first window)")
    ap.add_argument("--budget-s", type=positive_float,
                    help="stop the soak at the first sample after this many seconds of steps (default: run every step)")
    ap.add_argument("--collectives", choices=["flashinfer", "process-group"], default="flashinfer",
                    help="on a GPU, the sums the boundaries leave unfused: FlashInfer's all-reduce (default) or the process group")
    ap.add_argument("--allow-unfused", action="store_true",
                    help="on a GPU, pass even when the flashinfer fusion did not bind (default: that fails the soak)")
    ap.add_argument("--max-growth-mib", type=int, default=0, help="allowed growth of memory_allocated (MiB)")
    ap.add_argument("--max-reserved-growth-mib", type=int, default=64,
                    help="allowed growth of memory_reserved and of the device's used memory (MiB)")
    ap.add_argument("--max-tensor-growth", type=int, default=0, help="allowed growth of live tensors")
    ap.add_argument("--only", choices=["soak", "kill"], help="run one of the two parts (default both)")
    ap.add_argument("--no-kill", action="store_true", help="skip the killed-rank check (as --only soak)")
    ap.add_argument("--kill-step", type=positive_int, default=3, help="the decode step the last rank dies in")
    ap.add_argument("--step-deadline", type=positive_float, default=5.0,
                    help="seconds a survivor waits for its GPU step before it raises (under the launcher's 10 s grace)")
    ap.add_argument("--kill-deadline", type=positive_float, default=60.0,
                    help="seconds from the death within which the launcher must report it")
    ap.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds for the whole soak")
    ap.add_argument("--out", default="benchmarks/results/gpu_soak.json")
    ap.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_soak.py: error: no CUDA device is visible; run on a GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    soak, kill = args.only in (None, "soak"), args.only in (None, "kill") and not args.no_kill
    if soak and (args.window >= args.steps or args.sample_every > args.steps - args.window):
        print(f"gpu_soak.py: error: --steps {args.steps} leaves no sample after the first --window {args.window} "
              f"(every --sample-every {args.sample_every}); raise --steps or lower the others", file=sys.stderr)
        return 2
    job = _job(args)
    result = {"options": {k: v for k, v in vars(args).items()}, "model": job["hf_config"], "dtype": job["dtype"]}
    if args.device == "cuda":
        result["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    result["soak"] = run_soak(args, job) if soak else None
    result["kill"] = run_kill(args, job) if kill else None
    result["ok"] = all(part is None or part["ok"] for part in (result["soak"], result["kill"]))
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
    if soak is not None:
        verdict = "OK" if soak["ok"] else ("UNFUSED" if args.device == "cuda" and not soak["fused"] else "GREW")
        print(f"soak: {soak['steps']} of {args.steps} decode steps, TP={args.tp}, {result['dtype']}, "
              f"hidden {result['model']['hidden_size']} x {result['model']['num_hidden_layers']} layers, {args.device}"
              f"{', flashinfer fused' if soak['fused'] else ''}: {verdict}")
        if soak["note"]:
            print(f"  {soak['note']}")
        for r in soak["ranks"]:
            first, last = r["samples"][0], r["samples"][-1]
            print(f"  rank {r['rank']}: {r['steps_per_s']:.1f} steps/s")
            print(f"    before the first step: {_line(r['before'])}")
            print(f"    step {first['step']} (warmed up): {_line(first)}")
            print(f"    step {last['step']} (last): {_line(last)}" + (f"; grew: {', '.join(r['grew'])}" if r["grew"] else ""))
            print(f"    after release_model: {_line(r['after_release'])}")
            print(f"    collectives per decode step: first {r['collectives'].get('first')}, last {r['collectives'].get('last')}")
        fi = soak["ranks"][0]["prepared"]["flashinfer"]
        if fi:
            print("  " + fi.replace("\n", "\n  "))
    kill = result["kill"]
    if kill is not None:
        print(f"kill: rank {kill['victim']} killed mid-forward: {'OK' if kill['ok'] else 'FAIL'} ({kill['outcome']} "
              f"{kill['seconds_from_death_to_error']} s after the death; processes left: {kill['processes_left'] or 'none'})")
        for rank, line in kill["survivors"].items():
            print(f"  rank {rank}: {line}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
