"""Which kernels a rank ran, as the selection function recorded them: the "kernels" object of
`layer-boundary run --json`, and the two lines its human output gives them.

Per boundary (by stage label): the fusion providers that took the stage and those that declined,
with their reasons; the consumer candidates of its input in the order they are asked and, in
eager runs, how often each accepted or declined (`counting_candidates`); the add + norm its norm
chose. Model-wide: every RMSNorm's kernels (add + norm and plain norm, per device and dtype it
ran with, identical choices grouped) and every other recorded choice (a family's rope, q/k norm +
rope, decode-attention and gated-activation kernels, its residual kind, the family itself).
Under torch.compile nothing is counted per call: a compiled graph replays the candidates it was
traced with, and the report says so.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._residual.add_norm import is_rms_norm
from .._residual.kernels import TORCH, choices_of
from .._stage import boundaries_of

__all__ = ["rank_report", "choices", "summary_lines", "LOCAL_KERNELS"]

#: the model-wide kernel kinds the summary names, in its order, with their words
LOCAL_KERNELS = {
    "rope_kernels": "rope",
    "qk_norm_rope_kernels": "q/k norm + rope",
    "decode_attention_kernels": "decode attention",
    "gated_activation_kernels": "gated activation",
}


def _declines(selection) -> list[dict]:
    return [a.summary() for a in selection.declined]


def _providers(selection) -> dict:
    if selection is None:
        return {"chosen": [], "declined": []}
    return {"chosen": [{"candidate": a.candidate, "plugin": a.plugin} for a in selection.accepted], "declined": _declines(selection)}


def _candidates(plan, counts) -> list[dict]:
    """The consumer candidates of the plan's inputs (every batch variant's, each once, in order)."""
    seen: dict[str, dict] = {}
    for path in plan.paths.values():
        for cand in path.entry.candidates:
            entry = seen.setdefault(cand.name, {"candidate": cand.name, "plugin": cand.plugin})
            if counts is not None:
                entry["accepted"] = counts[(plan.label, cand.name, "accepted")]
                entry["declined"] = counts[(plan.label, cand.name, "declined")]
    return list(seen.values())


def _on(key: tuple) -> str:
    device, dtype, *rest = key
    text = f"{device} {str(dtype).replace('torch.', '')}"
    if rest and rest[0] != dtype:
        text += f" (contribution {str(rest[0]).replace('torch.', '')})"
    return text


def _norm_choices(norm) -> list[dict]:
    out = []
    for op, key, choice in choices_of(norm):
        entry = {"op": op, "on": _on(key), "kernel": choice.name, "plugin": choice.plugin}
        if choice.selection is not None:
            entry["declined"] = _declines(choice.selection)
        if choice.reason:
            entry["reason"] = choice.reason
        out.append(entry)
    return out


def _norms(model) -> list[dict]:
    """Every RMSNorm's choices, identical ones grouped (the modules named)."""
    groups: dict[str, dict] = {}
    for name, module in model.named_modules() if isinstance(model, torch.nn.Module) else ():
        if not is_rms_norm(module):
            continue
        for entry in _norm_choices(module):
            key = repr(sorted(entry.items()))
            group = groups.setdefault(key, {**entry, "norms": []})
            group["norms"].append(name or type(module).__name__)
    return list(groups.values())


def _kernel_summary(selection) -> dict:
    out = selection.summary()
    if out["chosen"] is None and selection.point in LOCAL_KERNELS:
        out["chosen"] = TORCH  # nothing accepted: the family's torch path runs
    return out


def rank_report(model, selections, counts, compiled: Optional[str] = None) -> dict:
    """The report of one rank: `selections` recorded around building and preparing `model`,
    `counts` from `counting_candidates()` around its forwards (None: not counted), `compiled`
    the torch.compile backend the forwards ran through (None: eager)."""
    by_label: dict[str, list] = {}
    for selection in selections:
        if selection.label is not None:
            by_label.setdefault(selection.label, []).append(selection)
    boundaries = []
    for boundary in boundaries_of(model) if isinstance(model, torch.nn.Module) else ():
        plan = boundary.plan
        mine = by_label.get(plan.label, [])
        chain = next((s for s in mine if s.point == "fusion_providers"), None)
        if chain is not None:  # a label built twice (outside a layer_stack): pair them in order
            mine.remove(chain)
        entry = {"label": plan.label, "providers": _providers(chain), "candidates": _candidates(plan, counts)}
        norm = _norm_choices(plan.norm) if is_rms_norm(plan.norm) else []
        if norm:
            entry["norm"] = norm
        other = [s.summary() for s in mine if s.point != "fusion_providers"]
        if other:
            entry["other"] = other
        boundaries.append(entry)
    if compiled is not None:
        counting = (f"off: compiled with torch.compile (backend {compiled}); a compiled graph replays the candidates it was "
                    "traced with, and the choices here are those it captured")
    elif counts is None:
        counting = "off"
    else:
        counting = "eager: every candidate's answers counted per call (not inside a CUDA-graph capture)"
    return {
        "counting": counting,
        "boundaries": boundaries,
        "norms": _norms(model),
        "model": [_kernel_summary(s) for s in selections if s.label is None and s.point != "add_norm_kernels"],
    }


def choices(report: dict) -> dict:
    """The report without its counts: what must agree between ranks of one model."""
    boundaries = [{**b, "candidates": [{"candidate": c["candidate"], "plugin": c["plugin"]} for c in b["candidates"]]}
                  for b in report["boundaries"]]
    return {**report, "boundaries": boundaries}


def _reasons(declined: list[dict]) -> str:
    return ", ".join(f"{d['candidate']} ({d.get('reason', 'declined')})" for d in declined)


def summary_lines(report: dict) -> list[str]:
    """Two lines: the fusion candidates that ran at the boundaries (with their counts, or the
    chains when nothing was counted) and the providers that declined; the local kernels."""
    totals: dict[str, list] = {}
    declined: dict[tuple, dict] = {}
    for b in report["boundaries"]:
        for c in b["candidates"]:
            total = totals.setdefault(c["candidate"], [0, 0, 0])
            total[0] += c.get("accepted", 0)
            total[1] += c.get("declined", 0)
            total[2] += 1
        for d in b["providers"]["declined"]:
            declined.setdefault((d["candidate"], d.get("reason")), d)
    counted = any("accepted" in c for b in report["boundaries"] for c in b["candidates"])
    if not totals:
        fusion = "fusion: no boundary completes a sum at its input"
    elif counted:
        ran = [f"{name} accepted {a}, declined {d}" for name, (a, d, _) in totals.items() if a or d]
        fusion = "fusion: " + ("; ".join(ran) or "no candidate was asked")
    else:
        fusion = "fusion (not counted: " + report["counting"].split(";")[0] + "): " + "; ".join(
            f"{name} at {n} boundar{'y' if n == 1 else 'ies'}" for name, (_, _, n) in totals.items())
    if declined:
        fusion += "; providers declined: " + _reasons(list(declined.values()))
    kernels: dict[str, list] = {}
    for group in report["norms"]:
        if group["op"] == "add + norm":
            kernels.setdefault(group["kernel"], []).extend(group["norms"])
    local = [f"add + norm {name} ({len(set(norms))} norm{'s' if len(set(norms)) != 1 else ''})" for name, norms in kernels.items()]
    for point, words in LOCAL_KERNELS.items():
        chosen = sorted({s["chosen"] for s in report["model"] if s["point"] == point})
        if chosen:
            local.append(f"{words} {', '.join(chosen)}")
    return [fusion, "local kernels: " + ("; ".join(local) or "none chosen")]
