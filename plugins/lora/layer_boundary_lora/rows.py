"""Which LoRA adapter each row of a compute input uses, in that input's own row order.

The engine states it once per forward, for this rank's attention rows:
`Forward.extras["lora_ids"]`, a 1-D integer tensor with one adapter slot per row (-1: the base
model only). A stage's compute may hold other rows: an FFN under attention DP runs on the rows
of every DP rank, a latent projection under input scattering on this rank's attention-TP slice.
`lora_rows(forward, layout)` moves the ids to those rows with the same primitives that move the
hidden states, once per forward and layout, and groups each adapter's rows for batched execution.
"""

from __future__ import annotations

import torch

from layer_boundary import Forward, RowLayout
from layer_boundary.plugin import dp_gather, take_slice

__all__ = ["IDS_KEY", "LoraRows", "lora_rows", "local_adapter_ids"]

#: the Forward.extras key holding the adapter slot of every attention row of this rank
IDS_KEY = "lora_ids"
_CACHE_KEY = "lora.rows"


class LoraRows:
    """The adapter slot of every row of one compute input (-1: no adapter), and `segments`:
    `(slot, row indices)` for each adapter present, in slot order, so a LoRA layer runs one
    pair of small GEMMs per adapter instead of one per row.

    Inside a compiled region `segments` is None: which adapters are present and their row
    counts depend on tensor data, which a graph cannot hold, so a LoRA layer there runs every
    adapter it holds on every row and keeps each row's own (by `adapter_ids`)."""

    __slots__ = ("layout", "adapter_ids", "segments")

    def __init__(self, layout: RowLayout, adapter_ids: torch.Tensor):
        self.layout = layout
        self.adapter_ids = adapter_ids
        self.segments = None if torch.compiler.is_compiling() else _segments(adapter_ids)

    @property
    def adapters(self) -> tuple[int, ...]:
        if self.segments is None:
            raise RuntimeError("the adapters present are not known inside a compiled region; read adapter_ids")
        return tuple(slot for slot, _ in self.segments)

    def __repr__(self) -> str:
        if self.segments is None:
            return f"LoraRows({self.layout.value}, {self.adapter_ids.numel()} rows, compiled)"
        counts = ", ".join(f"{slot}: {rows.numel()}" for slot, rows in self.segments)
        return f"LoraRows({self.layout.value}, {self.adapter_ids.numel()} rows, adapters {{{counts}}})"


def _segments(ids: torch.Tensor) -> tuple:
    if ids.numel() == 0:
        return ()
    present = torch.unique(ids).tolist()  # one host sync per forward and layout, not per layer
    return tuple((slot, (ids == slot).nonzero().flatten()) for slot in present if slot >= 0)


def local_adapter_ids(fwd: Forward) -> torch.Tensor:
    """This rank's ids from the Forward, checked; all -1 when the batch names no adapters."""
    ids = fwd.extras.get(IDS_KEY)
    if ids is None:
        device = fwd.parallel.groups["attn_dp"].device
        return torch.full((fwd.num_tokens,), -1, dtype=torch.long, device=device)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype in (torch.bool,) or ids.is_complex():
        shown = f"a {ids.dim()}-D {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(
            f"Forward.extras[{IDS_KEY!r}] must be a 1-D integer tensor with one adapter slot per row "
            f"(-1 for the base model), got {shown}"
        )
    if ids.shape[0] != fwd.num_tokens:
        raise ValueError(
            f"Forward.extras[{IDS_KEY!r}] has {ids.shape[0]} entries but this rank's batch has {fwd.num_tokens} rows; "
            "give one adapter slot per row of this rank's attention rows (a microbatch needs its own slice)"
        )
    if torch.compiler.is_compiling():  # the values are data: checked when the graph runs
        return torch.ops.layer_boundary_lora.checked_ids(ids)
    _check_slots(ids)
    return ids.to(torch.long)


def _check_slots(ids: torch.Tensor) -> None:
    if ids.numel() and int(ids.min()) < -1:
        raise ValueError(f"Forward.extras[{IDS_KEY!r}] holds {int(ids.min())}; adapter slots are >= 0, and -1 means no adapter")


@torch.library.custom_op("layer_boundary_lora::checked_ids", mutates_args=())
def checked_ids(ids: torch.Tensor) -> torch.Tensor:
    """The ids as long, after the eager check of their values: one graph node whose output the
    LoRA layers read, so no compiler drops the check."""
    _check_slots(ids)
    return ids.to(torch.long, copy=True)


@checked_ids.register_fake
def _(ids):
    return torch.empty_like(ids, dtype=torch.long)


class _ForwardRows:
    """Per-forward cache: the checked local ids and the LoraRows of each layout asked for."""

    __slots__ = ("forward", "local", "by_layout")

    def __init__(self, fwd: Forward):
        self.forward = fwd
        self.local = local_adapter_ids(fwd)
        self.by_layout: dict = {}


def _ids_on(layout: RowLayout, cache: _ForwardRows) -> torch.Tensor:
    fwd, local = cache.forward, cache.local
    if layout is RowLayout.DP_LOCAL:
        return local
    if layout is RowLayout.ATTN_TP_SLICE:
        return take_slice(local, fwd)
    # Shift by one so that the zero rows MAX_LEN padding inserts come back as -1 (no adapter).
    return dp_gather(local + 1, fwd) - 1


def lora_rows(fwd: Forward, layout: RowLayout) -> LoraRows:
    """The LoraRows of a compute input in `layout` (a DP-gathered layout gathers once per forward,
    over attention DP: every rank of the group asks at the same stage, so the gather is uniform)."""
    cache = fwd.extras.get(_CACHE_KEY)
    if cache is None or cache.forward is not fwd:  # a child Forward copies its parent's extras
        cache = _ForwardRows(fwd)
        fwd.extras[_CACHE_KEY] = cache
    rows = cache.by_layout.get(layout)
    if rows is None:
        rows = cache.by_layout[layout] = LoraRows(layout, _ids_on(layout, cache))
    return rows
