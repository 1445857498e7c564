"""Choosing the reference models' plugin kernels once per model, agreed across the TP group.

Every model-wide kernel kind (`RopeKernel`, `QKNormRopeKernel`, `DecodeAttentionKernel`,
`GatedActivationKernel`) is chosen the same way at `prepare_model`, through the plugin API's
selection rule: each rank asks the kind's records in the selection order with the kind's typed
request, and `select_agreed` keeps the first record that *every* rank of the group accepts (one
all_reduce for all the kinds asked together, none when no record is registered), so no two
ranks of a model run different kernels; a factory that raised on one rank makes every rank
raise. The torch path (`TORCH`) is always last and never declines.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs

from layer_boundary.plugin import Selection, select, select_agreed

__all__ = ["TORCH", "KernelChoice", "choose", "local_choice", "named", "chain", "group_of", "describe_model"]

TORCH = "core.torch"


@attrs.frozen
class KernelChoice:
    """One kind's kernel for a model: its record name, the kernel (None: torch), and the
    records asked before it that some rank declined."""

    name: str
    kernel: Optional[Callable] = None
    declined: tuple[str, ...] = ()


def _choice(selection: Selection, records) -> KernelChoice:
    chosen = selection.chosen
    if chosen is None:
        return KernelChoice(TORCH, None, tuple(r.name for r in records))
    return KernelChoice(chosen.candidate, chosen.value, tuple(a.candidate for a in selection.declined))


def choose(asks: Sequence[tuple[str, Sequence, object, str]], group, device) -> list[KernelChoice]:
    """The rank-agreed choice of each (point, records, request, subject) in `asks`, in order.
    Collective over `group` when any record is registered: every rank must pass asks of the same
    points, in the same order (their requests are built from weights every rank of the group
    shares)."""
    return [_choice(s, records) for s, (_, records, _, _) in zip(select_agreed(asks, group, device), asks)]


def local_choice(point: str, records, request, subject: str = "") -> KernelChoice:
    """This rank's own answer, no agreement (plans do not communicate); a failing record raises."""
    return _choice(select(point, (request,), records=records, subject=subject, check=callable), records)


def named(choice: KernelChoice) -> str:
    """The choice for a plan line: its name, and the records declined before it."""
    return f"{choice.name} ({', '.join(choice.declined)} declined)" if choice.declined else choice.name


def chain(records) -> str:
    """The order the records of a kind are asked in, torch last."""
    return " > ".join([r.name for r in records] + [TORCH])


def group_of(model, module):
    """The group a model-wide kernel is agreed over: the model's TP group, else the module's."""
    parallel = getattr(model, "parallel", None)
    groups = getattr(parallel, "groups", None)
    return groups["tp"] if groups is not None and "tp" in groups else module.group


def describe_model(model) -> dict:
    """The model-wide lines of `layer-boundary plan`: what the attentions and the gated MLPs run
    (or would run) for rope, decode attention and act(gate) * up, and a model's own notes
    (`plan_notes()`: collectives its compute issues, such as OLMo-2's q/k statistic)."""
    from .attention_kernels import describe as describe_attention
    from .mlp_kernels import describe as describe_mlp

    lines = {"attention_kernels": describe_attention(model), "mlp_kernels": describe_mlp(model)}
    notes = getattr(model, "plan_notes", None)  # a model's own lines: collectives its compute issues
    if callable(notes):
        lines.update(notes())
    return {k: v for k, v in lines.items() if v}
