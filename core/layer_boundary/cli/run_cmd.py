"""`layer-boundary run`: spawn ranks, run a reference model through the boundaries (prefill then
decode steps), check the logits against Hugging Face or a single rank, report timings, the
collectives each step issued and which kernels ran (`kernel_report`).

Exit status (`usage.EXIT_STATUSES`): 1 a failed check, 2 bad input, 3 a plugin that failed
while the model was built, prepared or run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import attrs
import torch

from .._errors import FusionError, missing_feature
from .._families import ConfigError
from .._options import non_negative_int, positive_float, positive_int
from .._parallel import Topology, TopologyError
from .._plugins.manager import PluginError
from .._policy import resolve_reduction
from .families import INPUT_ERRORS, build, check_options, check_requirements, family_config, find_family, load_hf_config
from .kernel_report import choices, summary_lines
from .progress import wanted
from .usage import EXIT_CHECK_FAILED, EXIT_STATUSES, PluginFailure, UsageError

#: the errors of a plugin failing (its candidate, kernel or factory), exit status 3
PLUGIN_ERRORS = (FusionError, PluginError)

#: the largest relative error each dtype may show against the reference
TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
#: a router's scores pass through a softmax or a sigmoid, which turns a rounding of its logits
#: into a relative change of the scores as large as that rounding; they get twice the logits'
#: tolerance (bfloat16, measured up to 0.030 on qwen3_moe TP=4 attention DP 2, logits 0.016)
ROUTER_SCORE_FACTOR = 2
#: FP8 reads against the unquantized reference: E4M3 keeps 3 mantissa bits (relative rounding
#: up to 6%), measured 0.04-0.06 on the dense tiny models (a family may set its own "fp8"
#: tolerance: a MoE's routing flips on inputs that close, measured up to 0.26 on qwen3_moe)
FP8_TOLERANCE = 0.1


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a reference model through the boundaries and check it", epilog=EXIT_STATUSES)
    p.add_argument("--model", default="qwen3", help="a registered model family: qwen3 (default), qwen3_moe, gemma, ... (`layer-boundary plugins` lists them)")
    p.add_argument("--hf-config", help="a Hugging Face config: inline JSON, a config.json or a folder (default: embedded tiny)")
    p.add_argument("--checkpoint", help="a checkpoint folder (config.json + *.safetensors, or shards and model.safetensors.index.json), checked before any rank starts")
    p.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--attn-dp", type=positive_int, default=1, help="attention data-parallel size")
    p.add_argument("--attn-cp", type=positive_int, default=1, help="attention context-parallel size (needs layer-boundary-cp)")
    p.add_argument("--cp-order", default="zigzag", choices=["zigzag", "contiguous"], help="how a CP prefill splits each request over CP ranks")
    p.add_argument("--moe-ep", type=positive_int, default=1, help="expert-parallel size of MoE layers")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages, each with --tp ranks (qwen3, qwen3_moe, gemma, nemotron_h)")
    p.add_argument("--reduction", default="auto", choices=["ar", "rs", "rsv", "rs+rsv", "auto"])
    p.add_argument("--dp-padding", default="sum_len", choices=["sum_len", "max_len"])
    p.add_argument("--sequence-parallel", action="store_true", help="run prefill as a sequence-parallel batch")
    p.add_argument("--fp8", choices=["dynamic", "static"], help="FP8 reads at attention and dense-FFN inputs (checked with the FP8 tolerance)")
    p.add_argument("--tbo", action="store_true", help="two-batch overlap (needs layer-boundary-tbo)")
    p.add_argument("--lora", type=non_negative_int, default=0, metavar="N", help="N random LoRA adapters, requests round-robin (needs layer-boundary-lora)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"], help="default float32 (cpu), bfloat16 (cuda)")
    p.add_argument("--batch", type=positive_int, default=3, help="requests (default 3, lengths uneven)")
    p.add_argument("--prompt-tokens", type=positive_int, default=7, help="prompt length around which requests vary")
    p.add_argument("--decode-steps", type=non_negative_int, default=4, help="decode steps after the prefill (default 4; 0: prefill only)")
    p.add_argument("--check", default="hf", choices=["hf", "single", "none"])
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before a hung rank fails the run")
    p.add_argument("--save-logits", metavar="FILE", help="torch.save every request's logits per step (to compare runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def _config(args):
    """(the family's record, its parsed config, the topology) of the command line."""
    item = find_family(args.model)
    try:
        raw = None
        if args.checkpoint:
            folder = Path(args.checkpoint)
            if not folder.exists():
                raise ConfigError(f"--checkpoint {folder}: no such folder; pass the folder save_pretrained() wrote")
            if not folder.is_dir():
                raise ConfigError(f"--checkpoint {folder} is a file, not a folder; pass the folder save_pretrained() wrote")
            if not (folder / "config.json").is_file():
                raise ConfigError(f"checkpoint folder {folder} has no config.json; save it with save_pretrained()")
            raw = load_hf_config(str(folder), "--checkpoint")
        if args.hf_config:
            raw = load_hf_config(args.hf_config)
        config = family_config(item, raw)
        topology = Topology(tp=args.tp, attn_dp=args.attn_dp, attn_cp=args.attn_cp, moe_ep=args.moe_ep, pp=args.pp)
        config.check_topology(topology)
    except (ConfigError, TopologyError) as exc:
        raise UsageError(str(exc)) from None
    return item, config, topology


def _require_features(args, item, topology) -> None:
    from .._plugins.manager import get_registry

    registry = get_registry()
    if topology.attn_cp > 1 and not registry.cp_paths:
        raise UsageError(str(missing_feature(f"--attn-cp {topology.attn_cp}", "cp")))
    if args.tbo and not registry.overlaps:
        raise UsageError(str(missing_feature("--tbo", "tbo")))
    if args.lora and not registry.row_publishers_of("lora"):
        raise UsageError(str(missing_feature(f"--lora {args.lora}", "lora")))
    check_requirements(item)
    check_options(item, _options(args))
    if args.sequence_parallel and (topology.attn_dp > 1 or topology.attn_tp < 2 or topology.attn_cp > 1):
        raise UsageError("--sequence-parallel needs attention TP > 1 and no attention DP or CP")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible; run on a GPU machine or use --device cpu")


def _preflight(item, config, topology, policy, options):
    """Build rank 0's model on the meta device (no memory, no process group), so a construction
    error (a missing plugin, an impossible stage combination) is one line before any rank
    starts; the meta model is returned (a checkpoint is checked against it)."""
    from .._parallel import Parallel
    from .plan_cmd import PlanningCollectives

    parallel = Parallel.create(topology, 0, lambda name, ranks: PlanningCollectives(name, ranks, 0))
    try:
        model = build(item, config, parallel, reduction=policy, device="meta", options=options)
    except INPUT_ERRORS as exc:
        raise UsageError(str(exc)) from None
    from .._forward import BatchVariant
    from .._stage import boundaries_of

    wanted = [(topology.attn_cp > 1, BatchVariant.CONTEXT_PARALLEL, f"--attn-cp {topology.attn_cp}")]
    for needed, variant, flag in wanted:  # prefill runs as such a batch: every stage needs that path
        if not needed:
            continue
        for boundary in boundaries_of(model):
            if variant not in boundary.plan.paths:
                message, _, reason = boundary.plan.missing_variant(variant).partition("\n")
                raise UsageError(f"{flag}: {message}" + (f" ({reason})" if reason else ""))
    return model


def _check_checkpoint(folder, item, config, model) -> None:
    """The checkpoint's files, tensors, shapes and dtypes against the config, from the headers
    alone: every problem one line naming the file, before any rank starts."""
    from .checkpoint import check_checkpoint

    try:
        check_checkpoint(folder, config, item.record, model)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


@attrs.frozen
class Reference:
    """What the run is compared with: per request a list of per-step logits, and how they were
    made (`comparison`), the routing report of a run routed like the reference, the single
    rank's Hugging Face parity where that stands in for Hugging Face, and a note."""

    logits: list
    comparison: str = "logits"
    routing: Optional[dict] = None
    hf_parity: Optional[dict] = None
    note: Optional[str] = None
    #: the relative error the reference is exact to where looser than the family's tolerance
    #: (a Hugging Face release whose arithmetic differs: `HfReference.tolerance`), or 0
    tolerance: float = 0.0


PINNED = "logits against one rank routed like the run"


def _routing_plan(args, item, config, policy, options, meta_model) -> tuple[bool, Optional[str]]:
    """(whether the run records its routing and the reference follows it, a note for the
    verdict): a MoE model whose family names its routers (`routed_layers()`) is pinned in every
    dtype below float64, where a rounding can pick another expert for a token that nearly ties."""
    from .._parallel import Parallel
    from .routing import routed_layer_ids

    if args.check == "none" or args.dtype == "float64":
        return False, None
    routed = routed_layer_ids(meta_model)
    if routed is not None and not routed and args.pp > 1:  # rank 0's stage holds no MoE layer: ask the whole model
        routed = routed_layer_ids(build(item, config, Parallel.single(), reduction=policy, device="meta", options=options))
    if routed is None:
        if not _routes_experts(config.hf):
            return False, None
        return False, (f"routing not pinned: the {args.model} family's model names no routers (routed_layers()), so in "
                       f"{args.dtype} a token whose experts nearly tie may route elsewhere than in the reference; "
                       "check the boundaries with --dtype float64 if this fails")
    return bool(routed), None


def _routes_experts(hf: dict) -> bool:
    """Whether a Hugging Face config describes routed experts."""
    return any(int(hf.get(key) or 0) > 0 for key in ("num_experts", "n_routed_experts", "num_local_experts"))


def _reference(args, item, config, job, dtype, results, pinned: bool, note: Optional[str]) -> Optional[Reference]:
    """The reference of `--check`, or None for --check none. A pinned run is compared with one
    rank routed like it; for --check hf that rank's own parity with Hugging Face is checked in
    float64 (no expert nearly ties there), which carries the comparison to Hugging Face."""
    from .._parallel import Parallel
    from .runner import run_rank

    if args.check == "none":
        return None
    if pinned:
        from .routing import PinnedRouting, compare_routing, merge_routing, routing_failure

        merged = merge_routing(results, job)
        if merged.unkeyed is None:
            single = _single_job(job)
            tolerance = ROUTER_SCORE_FACTOR * _tolerance(args, item, args.dtype)
            parity = _hf_parity(args, item, config, job) if args.check == "hf" else None
            comparison = PINNED
            try:
                ours = run_rank(Parallel.single(), _with(single, routing=PinnedRouting(merged.experts)))
            except RuntimeError as exc:  # a layer or a token the run never routed
                ours = run_rank(Parallel.single(), single)
                comparison = "logits against one rank (routing not pinned)"
                routing = routing_failure(f"the reference cannot route like the run: {exc}", tolerance)
            else:
                routing = compare_routing(merged, ours["routing"]["entries"], tolerance, job)
            logits = [ours["logits"][r] for r in range(len(job.prompts))]
            return Reference(logits, comparison, routing=routing, hf_parity=parity)
        note = f"routing not pinned: {merged.unkeyed}"
    if args.check == "single":
        single = run_rank(Parallel.single(), _single_job(job))
        return Reference([single["logits"][r] for r in range(len(job.prompts))], note=note)
    logits, tolerance = _hf_reference_logits(args, item, config, job, dtype)
    return Reference(logits, note=note, tolerance=tolerance)


def _single_job(job):
    """The job of the single-rank reference: one rank on the CPU, every option but TBO."""
    return _with(job, topology=Topology(), device="cpu", progress=False, sequence_parallel=False,
                 options={k: v for k, v in job.options.items() if k != "tbo"}, routing=None)


def _hf_reference_logits(args, item, config, job, dtype):
    """(per request the Hugging Face reference's per-step logits, the relative error it is exact
    to where looser than the family's tolerance, or 0)."""
    from .oracle import OracleError, hf_logits, installed_transformers, reference_of

    state = None if args.checkpoint else torch.load(job.weights)
    try:
        reference = reference_of(item.record, config, dtype, state=state, checkpoint=args.checkpoint, requests=len(job.prompts),
                                 options=job.options)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    prompts = [torch.tensor(p) for p in job.prompts]
    try:
        out = hf_logits(reference, prompts, job.decode_tokens)
    except OracleError as exc:
        raise UsageError(f"--check hf: {exc} (transformers {installed_transformers()})") from None
    return [[t.float() if t.dtype in (torch.bfloat16, torch.float16) else t for t in steps] for steps in out], reference.tolerance or 0.0


def _hf_parity(args, item, config, job) -> dict:
    """One rank of the family's model against Hugging Face, both in float64."""
    from .._parallel import Parallel
    from .runner import run_rank

    single = run_rank(Parallel.single(), _with(_single_job(job), dtype="float64"))
    ours = [single["logits"][r] for r in range(len(job.prompts))]
    theirs, exact_to = _hf_reference_logits(args, item, config, job, torch.float64)
    tolerance = max(_tolerance(args, item, "float64"), exact_to)
    return {"dtype": "float64", **_compare(ours, theirs, tolerance)}


def _options(args) -> dict:
    """The run options (`RunJob.options`: the family's `BuildRequest.options`, and every
    forward's `extras`)."""
    options = {k: v for k, v in (("tbo", args.tbo), ("lora", args.lora), ("fp8", getattr(args, "fp8", None))) if v}
    if args.attn_cp > 1:
        options["cp_order"] = args.cp_order
    if args.lora:
        options["lora_seed"] = args.seed  # every rank and the oracle draw the same adapters
    return options


def _with(job, **changes):
    return attrs.evolve(job, **changes)


def _tolerance(args, item, dtype: str) -> float:
    """The largest relative logits error of a run in `dtype`: the dtype's, loosened where the
    family's reference is not reproducible beyond it, and FP8 reads' own."""
    tolerances = item.record.tolerances
    tolerance = max(TOLERANCES[dtype], tolerances.get(dtype, 0.0))
    if getattr(args, "fp8", None):
        # vs HF: the quantization error itself; vs a single rank: a reordered sum can flip an
        # E4M3 rounding, so the same bound applies
        tolerance = max(tolerance, tolerances.get("fp8", FP8_TOLERANCE))
    return tolerance


def _compare(got, reference, tolerance: float) -> dict:
    """Per request lists of per-step logits against the reference's: the largest absolute
    error, the relative error (over the reference's largest), and whether it is within."""
    max_abs = 0.0
    scale = 0.0
    finite = True
    for ours_steps, theirs_steps in zip(got, reference):
        for ours, theirs in zip(ours_steps, theirs_steps):
            ours64, theirs64 = ours.double(), theirs.double().reshape(ours.shape)
            # a NaN never compares greater: check finiteness explicitly so it cannot pass
            finite = finite and bool(torch.isfinite(ours64).all()) and bool(torch.isfinite(theirs64).all())
            max_abs = max(max_abs, (ours64 - theirs64).abs().max().item())
            scale = max(scale, theirs64.abs().max().item())
    if not finite:
        return {"max_abs_err": float("nan"), "rel_err": float("nan"), "tolerance": tolerance, "passed": False,
                "tolerance_bounds": "rel_err", "reference_max_abs": None}
    rel = max_abs / scale if scale else max_abs
    # the tolerance bounds the relative error (max abs err / max |reference logit|); a reference
    # of zeros has no scale, and then it bounds the absolute error
    return {"max_abs_err": max_abs, "rel_err": rel, "tolerance": tolerance, "passed": rel < tolerance,
            "tolerance_bounds": "rel_err" if scale else "max_abs_err", "reference_max_abs": scale}


def _verdict(args, item, results, reference: Optional[Reference]):
    report = {"reference": args.check, "max_abs_err": None, "rel_err": None, "passed": None}
    if reference is None:
        return report
    got = _logits(results)
    report["comparison"] = reference.comparison
    tolerance = max(_tolerance(args, item, args.dtype), reference.tolerance)
    report.update(_compare([got[r] for r in range(len(got))], reference.logits, tolerance))
    for name in ("routing", "hf_parity", "note"):
        value = getattr(reference, name)
        if value is not None:
            report[name] = value
            if isinstance(value, dict):
                report["passed"] = report["passed"] and value["passed"]
    return report


def _nodes(results, topology) -> dict:
    """Which node every rank ran on, checked against what each rank decided from its groups'
    all_gather (a rank that saw another table would have chosen other collectives)."""
    from ..nodes import NodeLayout

    by_rank = {r["rank"]: r for r in results}
    world = NodeLayout.from_hashes([by_rank[r]["node"] for r in range(topology.world_size)])
    single = {}
    for name in ("tp", "pp"):
        single[name] = True
        for members in topology.groups()[name]:
            expected = NodeLayout.from_hashes([by_rank[r]["node"] for r in members])
            seen = {r: tuple(by_rank[r]["node_layouts"][name]) for r in members}
            if any(v != expected.nodes for v in seen.values()):
                raise UsageError(f"ranks {list(members)} disagree about the nodes of their {name} group: {seen}")
            single[name] = single[name] and expected.single_node
    return {"count": world.count, "of_rank": list(world.nodes), "tp_within_a_node": single["tp"], "pp_within_a_node": single["pp"]}


def _logits(results) -> dict:
    got: dict[int, list] = {}
    for res in results:
        got.update(res["logits"])
    return dict(sorted(got.items()))


def _summaries(results, job):
    rank0 = min(results, key=lambda r: r["rank"])
    steps = list(rank0["timings"])
    prefill = steps[0]
    decodes = steps[1:]
    total_tokens = sum(rank0["tokens"].values())
    wall = max(sum(r["timings"].values()) for r in results)
    timings = {
        "build_s": max(r["build_s"] for r in results),
        "prefill_s": max(r["timings"][prefill] for r in results),
        "decode_step_s": (sum(max(r["timings"][s] for r in results) for s in decodes) / len(decodes)) if decodes else None,
        "tokens_per_s": total_tokens / wall if wall else None,
        "per_step_s": {s: max(r["timings"][s] for r in results) for s in steps},
    }
    collectives = {"prefill": rank0["collectives"][prefill]}
    if decodes:
        collectives["decode_step"] = rank0["collectives"][decodes[0]]
    return timings, collectives


def run(args) -> int:
    try:
        return _run(args)
    except PLUGIN_ERRORS as exc:  # a plugin failed in this process (the meta build, torchrun, --check single)
        raise PluginFailure(str(exc)) from None


def _run(args) -> int:
    from .runner import DTYPES, RunJob, make_requests

    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    item, config, topology = _config(args)
    _require_features(args, item, topology)
    try:
        policy = resolve_reduction(args.reduction, dict(config.hf)).value
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    options = _options(args)
    meta_model = _preflight(item, config, topology, policy, options)
    if args.checkpoint:
        _check_checkpoint(args.checkpoint, item, config, meta_model)
    pinned, note = _routing_plan(args, item, config, policy, options, meta_model)
    del meta_model
    dtype = DTYPES[args.dtype]
    if args.check == "hf":
        from .oracle import require_transformers

        try:
            require_transformers()
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    prompts, decode = make_requests(config.vocab_size, args.batch, args.prompt_tokens, args.decode_steps, args.seed)
    quiet = args.json or int(os.environ.get("RANK", "0")) != 0  # under torchrun only rank 0 talks
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="layer-boundary-") as tmp:
        weights = None
        if not args.checkpoint:
            weights = os.path.join(tmp, "weights.pt")
            draw = item.record.random_weights
            torch.save(draw(config, torch.float64 if dtype == torch.float64 else torch.float32, args.seed), weights)
        job = RunJob(
            model=args.model,
            hf_config=dict(config.hf),
            topology=topology,
            reduction=policy,
            dtype=args.dtype,
            device=args.device,
            weights=weights,
            checkpoint=args.checkpoint,
            prompts=prompts,
            decode_tokens=decode,
            sequence_parallel=args.sequence_parallel,
            dp_padding=args.dp_padding,
            progress=wanted(sys.stderr, machine_output=args.json) and not quiet,
            options=options,
            routing="record" if pinned else None,
        )
        say(
            f"layer-boundary run: {args.model} ({config.num_layers} layers), {topology.describe()}, reduction={policy}, "
            f"{args.dtype}, {args.device}" + (", two-batch overlap" if args.tbo else "")
        )
        start = time.perf_counter()
        results = _launch(job, topology, args, say)
        elapsed = time.perf_counter() - start
        say(f"  reference: {args.check}" + (" (one rank routed like the run)" if pinned else ""))
        reference = _reference(args, item, config, job, dtype, results, pinned, note)
    check = _verdict(args, item, results, reference)
    timings, collectives = _summaries(results, job)
    timings["wall_s"] = elapsed
    out = {
        "check": check,
        "config": {
            "model": args.model,
            "architecture": config.architecture,
            "layers": config.num_layers,
            "hidden": config.hidden_size,
            "topology": {k: getattr(topology, k) for k in ("tp", "attn_tp", "attn_dp", "attn_cp", "moe_ep", "moe_tp", "pp")},
            "reduction": policy,
            "dtype": args.dtype,
            "device": args.device,
            "batch": args.batch,
            "prompt_lengths": [len(p) for p in prompts],
            "decode_steps": args.decode_steps,
            "sequence_parallel": args.sequence_parallel,
            "tbo": args.tbo,
            "cp_order": args.cp_order if topology.attn_cp > 1 else None,
            "nodes": _nodes(results, topology),
        },
        "timings": timings,
        "collectives": collectives,
        "kernels": _kernels(results),
    }
    if args.save_logits:
        torch.save({"logits": _logits(results), "config": out["config"]}, args.save_logits)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_human(out)
    return 0 if check["passed"] in (True, None) else EXIT_CHECK_FAILED


def _kernels(results) -> dict:
    """Rank 0's kernel report, and whether every rank chose the same (counts aside); the ranks
    whose choices differ are listed (a per-rank add + norm kernel may, without changing a
    collective)."""
    by_rank = {r["rank"]: r["kernels"] for r in results}
    first = min(by_rank)
    differ = [rank for rank, report in sorted(by_rank.items()) if choices(report) != choices(by_rank[first])]
    return {"rank": first, **by_rank[first], "ranks_differ": differ}


def _plugin_failure(exc) -> "PluginFailure | None":
    """The first rank failure a plugin caused (anywhere in its exception chain), as one line."""
    names = {t.__name__ for t in PLUGIN_ERRORS}
    for rank, chain in sorted(exc.failures, key=lambda f: f[0]):
        for mro, message in chain:
            if names & set(mro):
                return PluginFailure(f"rank {rank}: {message}")
    return None


def _launch(job, topology, args, say):
    from ..launch import ProcessWorld, RankError, RankTimeout
    from .runner import run_rank

    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK") is not None and os.environ.get("WORLD_SIZE"):
        return _under_torchrun(job, topology)
    world = ProcessWorld(topology.world_size, device=args.device, timeout=args.timeout, collective_timeout=args.timeout)
    say(f"  spawning {topology.world_size} ranks ({world.backend})")
    if world.note:
        print(world.note, file=sys.stderr, flush=True)  # shown with --json too: the timings below are not measurements
    try:
        return world.run(run_rank, topology, job)
    except RankError as exc:
        raise _plugin_failure(exc) or UsageError(f"a rank failed: {exc}") from None
    except RankTimeout as exc:
        raise UsageError(f"a rank failed: {exc}") from None
    finally:
        world.close()


def _under_torchrun(job, topology):
    """Inside torchrun: this process is one rank; rank 0 gathers every rank's results."""
    import torch.distributed as dist

    from .._parallel import Parallel
    from ..placement import current_placement, place_ranks
    from .runner import run_rank

    placement = current_placement(job.device) or place_ranks(int(os.environ.get("WORLD_SIZE", 1)), job.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if job.device == "cuda":
        torch.cuda.set_device(placement.device_of(local_rank))
    if not dist.is_initialized():
        dist.init_process_group(placement.backend)
    if placement.note and dist.get_rank() == 0:
        print(placement.note, file=sys.stderr, flush=True)
    result = run_rank(Parallel.from_torch(topology), job)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        sys.exit(0)
    return gathered


def verdict_line(check: dict) -> str:
    """The check in one line that says what its tolerance bounds: the relative error, max abs
    err over the reference's largest |logit| (both printed), never the absolute error alone."""
    verdict = "PASS" if check["passed"] else "FAIL"
    relation = "<" if check["passed"] else ">="
    head = f"check vs {check['reference']}: {verdict}  "
    if check.get("reference_max_abs") is None:
        return head + f"logits not finite (NaN or inf; tolerance {check['tolerance']:.0e} relative)"
    if check["tolerance_bounds"] == "max_abs_err":
        return head + f"max abs err {check['max_abs_err']:.3e} {relation} tolerance {check['tolerance']:.0e} (absolute: the reference logits are all 0)"
    return head + (f"rel err {check['rel_err']:.3e} {relation} tolerance {check['tolerance']:.0e} "
                   f"(relative: max abs err {check['max_abs_err']:.3e} / max |reference logit| {check['reference_max_abs']:.3e})")


def _print_human(out):
    check, t, c = out["check"], out["timings"], out["collectives"]
    if check["passed"] is None:
        print("check: none")
    else:
        print(verdict_line(check))
        for line in _check_details(check, out["config"]["dtype"]):
            print(f"  {line}")
    decode = f"{t['decode_step_s'] * 1e3:.2f} ms" if t["decode_step_s"] is not None else "-"
    print(f"time: prefill {t['prefill_s'] * 1e3:.2f} ms, decode step {decode}, {t['tokens_per_s']:.1f} tokens/s (wall {t['wall_s']:.1f} s)")
    for step, counts in c.items():
        text = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
        print(f"collectives per {step} (rank 0): {text}")
    kernels = out["kernels"]
    first, second = summary_lines(kernels)
    print(f"kernels (rank {kernels['rank']}): {first}")
    print(f"  {second}" + (f" (ranks {kernels['ranks_differ']} chose otherwise; see --json)" if kernels["ranks_differ"] else ""))
    nodes = out["config"]["nodes"]
    if nodes["count"] > 1:
        print(f"nodes: {nodes['count']} (node of each rank: {nodes['of_rank']}; TP groups within a node: {nodes['tp_within_a_node']})")


def _check_details(check: dict, dtype: str) -> list[str]:
    """The lines under the verdict: which comparison ran, the routing, the Hugging Face parity."""
    pinned = f" ({dtype} MoE: the reference takes the run's experts)" if check["comparison"] == PINNED else ""
    lines = [f"compared: {check['comparison']}{pinned}"]
    routing = check.get("routing")
    if routing is not None:
        flips = (f"{routing['flipped']} of {routing['choices']} token-layer expert choices differ from the reference's own"
                 f" ({routing['flipped_fraction']:.1%})")
        if routing["flipped"]:
            flips += f", largest near-tie margin {routing['largest_flip_margin']:.1e}"
        lines.append(f"routing: {'PASS' if routing['passed'] else 'FAIL'}  {flips}; router scores rel err "
                     f"{routing['score_rel_err']:.3e} (tolerance {routing['score_tolerance']:.2g})")
        lines.extend(f"  {problem}" for problem in routing["problems"])
    parity = check.get("hf_parity")
    if parity is not None:
        lines.append(f"one rank vs hf in {parity['dtype']}: {'PASS' if parity['passed'] else 'FAIL'}  rel err "
                     f"{parity['rel_err']:.3e} (tolerance {parity['tolerance']:.0e})")
    if check.get("note"):
        lines.append(f"note: {check['note']}")
    return lines
