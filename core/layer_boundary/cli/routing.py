"""Routing checks of `layer-boundary run`: what every MoE layer's router chose, recorded per
token in the run, and a reference forced to route the same way.

In bfloat16 a one-ulp difference in a router's input (a sum reduced in another order) can pick
another expert for a token whose scores nearly tie, and the logits of that token, and of every
later token of its request, move far beyond any rounding tolerance. So a MoE run below float64
is compared with a reference that routes every token to the experts the run chose, and the
routing is checked on its own:

- every rank that routed a token chose the same experts (ranks route replicated rows);
- each router's experts are a top-k of the scores it ranked (nothing changed them after);
- the router scores of the run match the reference's, layer by layer, within twice the logits
  tolerance (a softmax or sigmoid turns a rounding of the router's logits into a relative change
  of the scores as large as that rounding);
- where the reference's own choice differs from the run's (a flip), the run's experts must be a
  near tie in the reference's choice scores, within that tolerance: an unexplained flip fails.
The fraction of flipped choices is reported, not bounded: a router whose scores nearly tie for
many tokens flips many of them, correctly.

A model takes part through `routed_layers()`: (layer id, router) for each MoE layer the rank
holds, each router with `choose(scores) -> (choice scores [T, E], experts [T, k])`, the one call
that picks its layer's experts (the router weighs whichever experts it returns). Recording and
pinning replace that method on the instances of one run only, so ordinary runs are untouched.

A token is keyed `request * stride + position`. An FFN computes on this rank's attention rows,
or under attention DP on every DP rank's rows in DP order (MAX_LEN: each padded to its slot),
of the batch or of each two-batch-overlap microbatch; each call's keys follow from that and the
step (`step_keys`), and a call whose row count disagrees leaves the run unpinned, with its reason.
"""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

__all__ = ["RoutingRecorder", "PinnedRouting", "RunRouting", "merge_routing", "compare_routing", "routing_failure", "routed_layer_ids", "UnkeyedRows"]

class UnkeyedRows(Exception):
    """A router saw rows whose tokens the run cannot name (a reason; the check is not pinned)."""


def routed_layer_ids(model) -> Optional[list[int]]:
    """The layer ids of a model's routers, or None when the model offers none (`routed_layers`)."""
    routed = getattr(model, "routed_layers", None)
    if routed is None:
        return None
    return sorted(layer for layer, _ in routed())


def key_stride(job) -> int:
    """Positions per request in a key: the longest prompt plus every decode step."""
    return max((len(p) for p in job.prompts), default=0) + len(job.decode_tokens) + 1


def step_keys(job, index: int, parallel) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Per microbatch of step `index` (0: the prefill), the keys of (this rank's attention rows,
    every DP rank's rows or None without attention DP); padding rows are -1.

    One microbatch, unless the run overlaps two (`tbo`): each DP rank's first half of its rows
    (rounded up), then the rest, in the order their layers run (the tbo adapter's split and
    schedule when the run names no split)."""
    topo = parallel.topology
    dp, attn_tp = topo.attn_dp, topo.attn_tp
    stride = key_stride(job)
    per_rank = []
    for d in range(dp):
        rows = []
        for r in range(d, len(job.prompts), dp):
            if index == 0:
                rows.extend(r * stride + p for p in range(len(job.prompts[r])))
            else:
                rows.append(r * stride + len(job.prompts[r]) + index - 1)
        per_rank.append(rows)
    parts = [per_rank]
    if job.options.get("tbo"):
        parts = [[rows[: (len(rows) + 1) // 2] for rows in per_rank], [rows[(len(rows) + 1) // 2 :] for rows in per_rank]]
    out = []
    for blocks in parts:
        local = torch.tensor(blocks[parallel.attn_dp_rank], dtype=torch.long)
        if dp == 1:
            out.append((local, None))
            continue
        if job.dp_padding == "max_len":
            slot = -(-max(len(b) for b in blocks) // attn_tp) * attn_tp
            blocks = [b + [-1] * (slot - len(b)) for b in blocks]
        out.append((local, torch.tensor([k for b in blocks for k in b], dtype=torch.long)))
    return out


@attrs.frozen
class PinnedRouting:
    """The experts each token was routed to, per (step, layer): `experts[(step, layer)]` is a
    [keys, k] table (-1 where no token), what a reference run is forced to choose."""

    experts: dict


class RoutingRecorder:
    """Records every router's choice of one run (and, with `pins`, forces it): installed by
    replacing `choose` on the model's router instances, removed by `restore()`."""

    def __init__(self, model, job, parallel, pins: Optional[PinnedRouting] = None):
        self.job, self.parallel, self.pins = job, parallel, pins
        self.entries: list = []
        self.unkeyed: Optional[str] = None
        self.step: Optional[str] = None
        self.keys: list = []
        self.calls: dict = {}
        self.routers = []
        for layer, router in model.routed_layers():
            self.routers.append((router, router.__dict__.get("choose")))
            router.choose = self._wrap(layer, router.choose)

    def begin(self, step: str, index: int) -> None:
        """The next forward is step `step` (its rows' keys follow from `index`)."""
        self.step, self.calls = step, {}
        self.keys = step_keys(self.job, index, self.parallel)

    def _keys_for(self, layer: int, rows: int) -> torch.Tensor:
        """The keys of a router call's rows: the next microbatch's at this layer."""
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        if call >= len(self.keys):
            raise UnkeyedRows(f"layer {layer} routed {call + 1} times at {self.step}, expected {len(self.keys)}")
        local, gathered = self.keys[call]
        keys, whose = (local, "this rank's attention rows") if gathered is None else (gathered, "every DP rank's rows")
        if rows != keys.shape[0]:
            which = f" of microbatch {call}" if len(self.keys) > 1 else ""
            raise UnkeyedRows(f"layer {layer} routed {rows} rows at {self.step}, not the {keys.shape[0]} of {whose}{which}")
        return keys

    def _wrap(self, layer: int, original):
        def choose(scores, *args, **kwargs):
            choice, experts = original(scores, *args, **kwargs)
            if self.unkeyed is not None:
                return choice, experts
            try:
                keys = self._keys_for(layer, choice.shape[0])
            except UnkeyedRows as exc:
                if self.pins is not None:  # a reference that cannot follow the run
                    raise RuntimeError(str(exc)) from None
                self.unkeyed = str(exc)
                return choice, experts
            self.entries.append((self.step, layer, keys, experts.detach().clone(), choice.detach().clone(), scores.detach().clone()))
            if self.pins is None:
                return choice, experts
            return choice, self._pinned(layer, keys, experts)

        return choose

    def _pinned(self, layer: int, keys: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        table = self.pins.experts.get((self.step, layer))
        valid = keys >= 0
        if table is None:
            raise RuntimeError(f"the run recorded no routing for layer {layer} at {self.step}")
        pinned = experts.clone()
        rows = table[keys[valid]]
        if (rows < 0).any():
            raise RuntimeError(f"the run recorded no routing for some tokens of layer {layer} at {self.step}")
        pinned[valid.to(experts.device)] = rows.to(device=experts.device, dtype=experts.dtype)
        return pinned

    def restore(self) -> None:
        """Give every router back its own `choose`."""
        for router, own in self.routers:
            if own is None:
                del router.choose
            else:
                router.choose = own
        self.routers = []

    def export(self) -> dict:
        """The recording on the CPU, padding rows dropped: {"entries": [(step, layer id, keys [T],
        experts [T, k], choice scores [T, E], the scores `choose` was given [T, E]), ...],
        "unkeyed": why the rows of a call could not be keyed, or None}."""
        out = []
        for step, layer, keys, experts, choice, scores in self.entries:
            keep = keys >= 0
            out.append((step, layer, keys[keep], experts.cpu()[keep], choice.cpu()[keep], scores.cpu()[keep]))
        return {"entries": out, "unkeyed": self.unkeyed}


@attrs.frozen
class RunRouting:
    """The run's routing merged over its ranks, per (step, layer) and key: the experts (sorted,
    -1 where no token), the choice scores and the router's scores (the lowest rank's), that
    rank; and what the merge found wrong."""

    experts: dict
    choice: dict
    scores: dict
    rank: dict
    choices: int  # token-layer choices recorded
    disagreements: list  # (step, layer, key, rank, experts, other rank, other experts)
    not_top_k: list  # (step, layer, key, rank, experts)
    unkeyed: Optional[str]


def merge_routing(results, job) -> RunRouting:
    """Merge every rank's recording (`results[i]["routing"]`)."""
    size = key_stride(job) * len(job.prompts)
    unkeyed = next((r["routing"]["unkeyed"] for r in results if r.get("routing") and r["routing"]["unkeyed"]), None)
    grouped: dict = {}
    not_top_k = []
    for res in sorted(results, key=lambda r: r["rank"]):
        for step, layer, keys, experts, choice, scores in (res.get("routing") or {"entries": ()})["entries"]:
            grouped.setdefault((step, layer), []).append((res["rank"], keys, experts.long().sort(dim=1).values, choice, scores))
            bad = _not_top_k(experts, choice)
            if bad.any():
                i = int(bad.nonzero()[0, 0])
                not_top_k.append((step, layer, int(keys[i]), res["rank"], sorted(experts[i].tolist())))
    tables = {name: {} for name in ("experts", "choice", "scores", "rank")}
    disagreements = []
    choices = 0
    for where, parts in grouped.items():
        k, e = parts[0][2].shape[1], parts[0][3].shape[1]
        table = torch.full((size, k), -1, dtype=torch.long)
        choice_of = torch.full((size, e), float("nan"), dtype=torch.float64)
        scores_of = torch.full((size, parts[0][4].shape[1]), float("nan"), dtype=torch.float64)
        owner = torch.full((size,), -1, dtype=torch.long)
        for rank, keys, experts, choice, scores in reversed(parts):  # the lowest rank's rows stay
            table[keys], choice_of[keys], scores_of[keys], owner[keys] = experts, choice.double(), scores.double(), rank
        for rank, keys, experts, _, _ in parts:
            differs = (table[keys] != experts).any(dim=1)
            if differs.any():
                i = int(differs.nonzero()[0, 0])
                key = int(keys[i])
                disagreements.append((*where, key, rank, experts[i].tolist(), int(owner[key]), table[key].tolist()))
        for name, value in zip(tables, (table, choice_of, scores_of, owner)):
            tables[name][where] = value
        choices += int((owner >= 0).sum())
    return RunRouting(**tables, choices=choices, disagreements=disagreements, not_top_k=not_top_k, unkeyed=unkeyed)


def _not_top_k(experts: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Rows whose experts are not a top-k of their choice scores (a NaN counts as not)."""
    if experts.numel() == 0:
        return torch.zeros(experts.shape[0], dtype=torch.bool)
    c = choice.double()
    chosen = c.gather(1, experts.long())
    others = c.scatter(1, experts.long(), float("-inf"))
    return ~(chosen.min(dim=1).values >= others.max(dim=1).values)


def _worse(a: float, b: float) -> bool:
    """Whether error `a` is worse than `b` (NaN is the worst)."""
    return math.isnan(a) or (not math.isnan(b) and a > b)


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs| over the entries finite in both."""
    finite = torch.isfinite(ours) & torch.isfinite(theirs)
    if not finite.any():
        return 0.0
    scale = theirs[finite].abs().max().item()
    diff = (ours - theirs)[finite].abs().max().item()
    return diff / scale if scale else diff


def routing_failure(problem: str, tolerance: float) -> dict:
    """The routing report of a reference that could not follow the run (`problem`)."""
    return {"choices": 0, "flipped": 0, "flipped_fraction": 0.0, "unexplained_flips": 0, "largest_flip_margin": 0.0,
            "score_rel_err": 0.0, "score_tolerance": tolerance, "ranks_disagree": 0, "not_top_k": 0,
            "problems": [problem], "passed": False}


def compare_routing(run: RunRouting, reference_entries, tolerance: float, job) -> dict:
    """The routing part of the verdict: the run's merged routing against the choices and scores
    of the reference that routed like it (`reference_entries`, its own choices recorded).

    `tolerance` bounds the router scores' error relative to their largest, layer by layer, and
    how far below the reference's k-th choice score a flipped token's experts may rank. Where
    the reference's choice excludes the run's experts outright (-inf: another expert group),
    the flip is a near tie of the groups' scores, which the score bound covers."""
    stride = key_stride(job)
    flips = unexplained = 0
    worst = (0.0, None)
    worst_flip = (0.0, None)
    for step, layer, keys, natural, choice, scores in reference_entries:
        table = run.experts.get((step, layer))
        if table is None or keys.numel() == 0:
            continue
        err = _rel(run.scores[(step, layer)][keys], scores.double())
        if worst[1] is None or _worse(err, worst[0]):
            worst = (err, (step, layer))
        picked = table[keys]
        flipped = (picked != natural.long().sort(dim=1).values).any(dim=1)
        count = int(flipped.sum())
        if not count:
            continue
        flips += count
        theirs = choice.double()
        finite = torch.isfinite(theirs)
        scale = theirs[finite].abs().max().item() if finite.any() else 1.0
        kth = theirs.topk(picked.shape[1], dim=1).values[:, -1]
        lowest = theirs.gather(1, picked).min(dim=1).values
        margin = ((kth - lowest) / (scale or 1.0)).masked_fill(~flipped | torch.isinf(lowest), 0.0)
        unexplained += int((flipped & ~(margin <= tolerance)).sum())
        i = int(margin.nan_to_num(float("inf")).argmax())
        m = margin[i].item()
        if worst_flip[1] is None or _worse(m, worst_flip[0]):
            key = int(keys[i])
            worst_flip = (m, {"step": step, "layer": layer, "request": key // stride, "position": key % stride,
                              "run": picked[i].tolist(), "reference": sorted(natural[i].tolist())})
    report = {
        "choices": run.choices,
        "flipped": flips,
        "flipped_fraction": flips / run.choices if run.choices else 0.0,
        "unexplained_flips": unexplained,
        "largest_flip_margin": worst_flip[0],
        "score_rel_err": worst[0],
        "score_tolerance": tolerance,
        "ranks_disagree": len(run.disagreements),
        "not_top_k": len(run.not_top_k),
    }
    problems = []
    if run.disagreements:
        step, layer, key, rank, experts, other, others = run.disagreements[0]
        problems.append(f"ranks {other} and {rank} routed request {key // stride} position {key % stride} of layer {layer} "
                        f"({step}) to experts {others} and {experts}")
    if run.not_top_k:
        step, layer, key, rank, experts = run.not_top_k[0]
        problems.append(f"rank {rank}'s layer {layer} ({step}) chose experts {experts} for request {key // stride} position "
                        f"{key % stride}, not a top-k of its own choice scores")
    if not worst[0] <= tolerance:
        problems.append(f"the router scores of layer {worst[1][1]} ({worst[1][0]}) differ from the reference's by "
                        f"{worst[0]:.3e} relative to their largest (tolerance {tolerance:.0e})")
    if unexplained:
        flip = worst_flip[1]
        problems.append(f"{unexplained} token-layer choice(s) picked experts the reference does not rank near its top-k, e.g. "
                        f"request {flip['request']} position {flip['position']} of layer {flip['layer']} ({flip['step']}): "
                        f"experts {flip['run']}, the reference's {flip['reference']} (margin {worst_flip[0]:.3e})")
    if worst_flip[1] is not None:
        report["largest_flip"] = worst_flip[1]
    report["problems"] = problems
    report["passed"] = not problems
    return report
