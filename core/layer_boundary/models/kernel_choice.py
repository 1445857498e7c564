"""Choosing the reference models' plugin kernels once per model, agreed across the TP group.

Every model-wide kernel kind (`RopeKernel`, `QKNormRopeKernel`, `DecodeAttentionKernel`,
`GatedActivationKernel`) is chosen the same way at `prepare_model`: each rank asks the kind's
records, in registry order (-priority, name), with the kind's typed request; the first record
that *every* rank of the group accepts wins, so no two ranks of a model run different kernels. One all_reduce carries
the acceptance flags of every kind asked together (none when no record is registered, which is
the same on every rank), plus one flag saying this rank's factories all answered: a factory
that raised on one rank makes every rank raise, instead of leaving its peers in the collective.
The torch path (`TORCH`) is always last and never declines.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import attrs
import torch

__all__ = ["TORCH", "KernelChoice", "choose", "local_choice", "named", "chain", "group_of"]

TORCH = "core.torch"


@attrs.frozen
class KernelChoice:
    """One kind's kernel for a model: its record name, the kernel (None: torch), and the
    records asked before it that some rank declined."""

    name: str
    kernel: Optional[Callable] = None
    declined: tuple[str, ...] = ()


def _local(records, request) -> tuple[list[Optional[Callable]], Optional[str]]:
    """Each record's kernel for `request` on this rank (None where it declines), and what went
    wrong (a factory that raised or returned a non-callable), or None. A failure is not raised
    here: the caller agrees on it first, so no rank raises while its peers wait in the agreement."""
    out: list[Optional[Callable]] = []
    for item in records:
        try:
            kernel = item.record.factory(request)
        except Exception as exc:  # noqa: BLE001 - reported after the agreement, on every rank
            return out + [None] * (len(records) - len(out)), f"kernel record {item.name!r} raised {type(exc).__name__}: {exc}"
        if kernel is not None and not callable(kernel):
            return out + [None] * (len(records) - len(out)), f"kernel record {item.name!r} returned {kernel!r}, which is not callable"
        out.append(kernel)
    return out, None


def _agree(flags: list[bool], group, device) -> list[bool]:
    """Per flag: whether every rank of `group` raised it (one all_reduce for all of them)."""
    if group is None or group.size == 1 or not flags:
        return flags
    tensor = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    total = group.all_reduce(tensor)
    return [int(round(v)) == group.size for v in total.tolist()]


def _first_agreed(records, kernels, agreed=None) -> KernelChoice:
    """The first record whose flag is agreed (`agreed=None`: this rank's own answers)."""
    agreed = [k is not None for k in kernels] if agreed is None else agreed
    for index, (item, kernel, ok) in enumerate(zip(records, kernels, agreed)):
        if ok:
            return KernelChoice(item.name, kernel, tuple(r.name for r in records[:index]))
    return KernelChoice(TORCH, None, tuple(r.name for r in records))


def choose(asks: Sequence[tuple[Sequence, object]], group, device) -> list[KernelChoice]:
    """The rank-agreed choice of each `(records, request)` in `asks`, in order. Collective over
    `group` when any record is registered: every rank must pass asks of the same kinds, in the
    same order (their requests are built from weights every rank of the group shares)."""
    answers = [_local(records, request) for records, request in asks]
    error = next((e for _, e in answers if e is not None), None)
    accepted = [k is not None for kernels, _ in answers for k in kernels]
    agreed, all_answered = [], True
    if accepted:  # no record registered (the same on every rank): nothing to agree on
        *agreed, all_answered = _agree(accepted + [error is None], group, device)
    if not all_answered:
        raise RuntimeError(error or "a kernel record failed at prepare_model on another rank of the TP group (its error is raised there)")
    choices, start = [], 0
    for (records, _), (kernels, _) in zip(asks, answers):
        choices.append(_first_agreed(records, kernels, agreed[start : start + len(kernels)]))
        start += len(kernels)
    return choices


def local_choice(records, request) -> KernelChoice:
    """This rank's own answer, no agreement (plans do not communicate); a failing record raises."""
    kernels, error = _local(records, request)
    if error is not None:
        raise RuntimeError(error)
    return _first_agreed(records, kernels, None)


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
