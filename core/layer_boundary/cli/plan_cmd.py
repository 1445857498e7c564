"""`layer-boundary plan`: what every boundary of a model does per batch variant, built without
running a forward or starting a process group."""

from __future__ import annotations

import json

from ..collectives import CollectivesBase
from .._parallel import Parallel, Topology, TopologyError
from .._policy import resolve_reduction
from .._options import non_negative_int, positive_int
from .families import INPUT_ERRORS, build, check_options, family_config, find_family, load_hf_config
from .usage import UsageError


class PlanningCollectives(CollectivesBase):
    """A group that knows its size and ranks but refuses to communicate (plans only)."""

    def __init__(self, name, ranks, rank):
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(rank)

    def _refuse(self, *args):
        raise RuntimeError("a planning group cannot communicate")

    _all_reduce = _reduce_scatter = _all_gather = _refuse


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="show what each boundary does for a model and topology")
    p.add_argument("--model", default="qwen3", help="a registered model family (`layer-boundary plugins` lists them)")
    p.add_argument("--hf-config")
    p.add_argument("--tp", type=positive_int, default=2)
    p.add_argument("--attn-dp", type=positive_int, default=1)
    p.add_argument("--attn-cp", type=positive_int, default=1)
    p.add_argument("--moe-ep", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages; --rank picks whose stage is shown")
    p.add_argument("--reduction", default="auto", choices=["ar", "rs", "rsv", "rs+rsv", "auto"])
    p.add_argument("--lora", type=non_negative_int, default=0, metavar="N", help="N LoRA adapters (needs layer-boundary-lora)")
    p.add_argument("--rank", type=non_negative_int, default=0, help="whose view to show (default 0)")
    p.add_argument("--device", default="meta",
                   help="where to build the model (default meta: no weights); on a GPU the add + norm lines name the chosen kernel")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run)


def build_plans(model_name: str, hf_config, topology: Topology, reduction: str, rank: int = 0, lora: int = 0, device="meta", dtype=None):
    """(config, policy, the boundaries' plans) of the model on `rank`."""
    config, policy, plans, _ = build_plan_report(model_name, hf_config, topology, reduction, rank, lora, device, dtype)
    return config, policy, plans


def build_plan_report(model_name: str, hf_config, topology: Topology, reduction: str, rank: int = 0, lora: int = 0, device="meta", dtype=None):
    """`build_plans` and the model-wide lines (the family's own kernel choices), as a fourth item."""
    item = find_family(model_name)
    options = {"lora": lora} if lora else {}
    check_options(item, options)
    try:
        config = family_config(item, load_hf_config(hf_config) if hf_config else None)
        config.check_topology(topology)
        policy = resolve_reduction(reduction, dict(config.hf))
        parallel = Parallel.create(topology, rank, lambda name, ranks: PlanningCollectives(name, ranks, rank))
        extra = {} if dtype is None else {"dtype": dtype}
        model = build(item, config, parallel, reduction=policy, device=device, options=options, **extra)
    except (TopologyError, *INPUT_ERRORS) as exc:
        raise UsageError(str(exc)) from None
    from .._stage import boundaries_of

    describe = item.record.describe
    model_wide = dict(describe(model)) if describe is not None else {}
    return config, policy, [b.plan.describe() for b in boundaries_of(model)], model_wide


def run(args) -> int:
    try:
        topology = Topology(tp=args.tp, attn_dp=args.attn_dp, attn_cp=args.attn_cp, moe_ep=args.moe_ep, pp=args.pp)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= args.rank < topology.world_size:
        raise UsageError(f"--rank {args.rank} is outside a world of {topology.world_size}")
    import torch

    dtype = getattr(torch, args.dtype) if args.device != "meta" else None
    config, policy, plans, model_wide = build_plan_report(
        args.model, args.hf_config, topology, args.reduction, args.rank, args.lora, args.device, dtype
    )
    if args.json:
        report = {"model": args.model, "topology": topology.describe(), "reduction": policy.value, **model_wide, "boundaries": plans}
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model}: {config.num_layers} layers, {topology.describe()}, reduction={policy.value}, rank {args.rank}'s view")
    for line in model_wide.values():
        print(f"  {line}")
    for plan in plans:
        print(f"\n{plan['label']}  {plan['stage']}  (producer: {plan['producer']}; consumer: {plan['consumer']})")
        if "add_norm" in plan:
            print(f"  {plan['add_norm']}")
        if "post_norm" in plan:
            print(f"  {plan['post_norm']}")
        for variant, paths in plan["variants"].items():
            print(f"  [{variant}]")
            for step in paths["entry"]:
                print(f"    in:  {step}")
            for step in paths["exit"]:
                print(f"    out: {step}")
        for variant, reason in plan.get("unsupported", {}).items():
            print(f"  [{variant}] no path: {reason}")
    return 0
