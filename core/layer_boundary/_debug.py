"""Debug mode (`LAYER_BOUNDARY_DEBUG=1`): checks too costly for every forward in production.

- a fusion candidate that declines after modifying its inputs is an error (fusions.py);
- at stack entry, every rank of the TP group compares its batch facts (variant, mode, DP
  padding, per-DP-rank token counts) with one small all-gather, so ranks that disagree fail
  with a message instead of entering different collectives and hanging.
"""

from __future__ import annotations

import torch

from ._env import env_flag

__all__ = ["DEBUG", "check_batch_facts"]

DEBUG = env_flag("LAYER_BOUNDARY_DEBUG")

_VARIANTS = ("ordinary", "context_parallel", "input_scattered", "sequence_parallel")
_MODES = ("extend", "decode", "idle")
_PADDINGS = ("sum_len", "max_len")


def check_batch_facts(fwd) -> None:
    """Raise BatchFactsError on every rank when the TP group's ranks disagree on batch facts."""
    from ._forward import BatchFactsError

    group = fwd.parallel.groups["tp"]
    if group.size == 1:
        return
    facts = [
        _VARIANTS.index(fwd.variant.value),
        _MODES.index(fwd.mode.value),
        _PADDINGS.index(fwd.dp_padding.value),
        *fwd.dp_counts,
    ]
    mine = torch.tensor([facts], dtype=torch.float64, device=group.device)
    every = group.all_gather(mine)
    names = ["variant", "mode", "dp_padding"] + [f"dp_counts[{i}]" for i in range(len(fwd.dp_counts))]
    for rank, row in enumerate(every.tolist()):
        for name, a, b in zip(names, row, facts):
            if a != b:
                raise BatchFactsError(
                    f"ranks disagree on batch facts: rank {group.ranks[rank]} has {name}={int(a)} but rank "
                    f"{group.ranks[group.rank]} has {int(b)}; every rank must build its Forward from the same batch facts"
                )
