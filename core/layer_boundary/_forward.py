"""Per-forward batch facts (`Forward`) and the scoped compute flags (`get_forward()`).

`Forward` plays the role an engine's forward-batch object plays: the boundary reads batch
facts from it and keeps the residual stream on it. Every fact that chooses a collective
(`dp_counts`, padding, the batch variant) must be the same on every rank; `num_tokens` is this
rank's own row count and must agree with `dp_counts`.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from typing import Any, ContextManager, Mapping, Optional, Sequence

import attrs

from .collectives import split_sizes

__all__ = [
    "BatchVariant",
    "ForwardMode",
    "DpPadding",
    "Forward",
    "ComputeFlags",
    "get_forward",
    "exit_scope_open",
    "publish_flags",
    "RowLayout",
    "ComputeRows",
    "get_compute_rows",
    "publish_compute_rows",
    "scoped_compute_rows",
    "BatchFactsError",
]


class BatchFactsError(ValueError):
    """Batch facts that contradict the topology or each other."""


class BatchVariant(enum.Enum):
    ORDINARY = "ordinary"
    CONTEXT_PARALLEL = "context_parallel"
    INPUT_SCATTERED = "input_scattered"
    SEQUENCE_PARALLEL = "sequence_parallel"

    # Enum's own hash stays: torch 2.11's Dynamo (the GPU machines' torch) cannot trace a dict
    # lookup keyed by an enum whose __hash__ is overridden (the identity hash saved ~0.1 us a lookup)

    def __repr__(self) -> str:
        return self.name


class ForwardMode(enum.Enum):
    EXTEND = "extend"  #: prefill / chunked prefill
    DECODE = "decode"
    IDLE = "idle"  #: a rank with no tokens that still joins collectives


class DpPadding(enum.Enum):
    """How attention-DP token sets are laid out on the gathered (full) rows."""

    SUM_LEN = "sum_len"  #: concatenated exactly
    MAX_LEN = "max_len"  #: each set padded to the longest (a multiple of attn_tp), so equal shares exist


class Forward:
    """Batch facts of one forward pass and its residual stream.

    Derived row counts are computed once here, so boundaries only read attributes.

    `cp` makes the batch a context-parallel one: a token mapping (a plugin builds it: see
    `layer_boundary.plugin.CpTokenMapping`) that says which of the batch's rows this
    attention-CP rank holds. The core relies on `take_local(x)` (this rank's rows of attention
    rows), `gather(x)` (every CP rank's rows back to attention rows in token order, a collective
    over attention CP) and `num_local`.
    """

    __slots__ = (
        "parallel",
        "num_tokens",
        "dp_counts",
        "dp_padding",
        "mode",
        "variant",
        "cp",
        "residual_stream",
        "extras",
        "microbatch",
        "slot_rows",
        "full_rows",
        "dp_offset",
        "slice_sizes",
        "slice_offset",
        "tp_share_sizes",
    )

    def __init__(
        self,
        parallel,
        num_tokens: int,
        *,
        dp_counts: Optional[Sequence[int]] = None,
        dp_padding: DpPadding = DpPadding.SUM_LEN,
        mode: ForwardMode = ForwardMode.EXTEND,
        sequence_parallel: bool = False,
        input_scattered: bool = False,
        cp: Any = None,
        extras: Optional[dict] = None,
        microbatch: Optional[int] = None,
    ):
        topo = parallel.topology
        if num_tokens < 0:
            raise BatchFactsError(f"num_tokens must be >= 0, got {num_tokens}")
        if dp_counts is None:
            if topo.attn_dp > 1:
                raise BatchFactsError(
                    f"attention DP of {topo.attn_dp} needs dp_counts (the token count of every DP rank, the same list on every rank)"
                )
            dp_counts = (int(num_tokens),)
        else:
            dp_counts = tuple(int(c) for c in dp_counts)
        if len(dp_counts) != topo.attn_dp:
            raise BatchFactsError(f"dp_counts has {len(dp_counts)} entries but attn_dp is {topo.attn_dp}")
        if dp_counts[parallel.attn_dp_rank] != num_tokens:
            raise BatchFactsError(
                f"dp_counts[{parallel.attn_dp_rank}] = {dp_counts[parallel.attn_dp_rank]} disagrees with this rank's "
                f"num_tokens = {num_tokens}"
            )
        if bool(sequence_parallel) + bool(input_scattered) + (cp is not None) > 1:
            raise BatchFactsError("a batch has at most one of sequence_parallel, input_scattered and cp")
        if (sequence_parallel or input_scattered) and topo.attn_dp > 1:
            raise BatchFactsError("sequence-parallel and input-scattered batches require attn_dp == 1")
        if type(dp_padding) is not DpPadding:  # an enum's call costs more than the check
            dp_padding = DpPadding(dp_padding)
        self.parallel = parallel
        self.num_tokens = num_tokens
        self.dp_counts = dp_counts
        self.dp_padding = dp_padding
        self.mode = mode if type(mode) is ForwardMode else ForwardMode(mode)
        if cp is not None:
            self.variant = BatchVariant.CONTEXT_PARALLEL
        elif input_scattered:
            self.variant = BatchVariant.INPUT_SCATTERED
        elif sequence_parallel:
            self.variant = BatchVariant.SEQUENCE_PARALLEL
        else:
            self.variant = BatchVariant.ORDINARY
        self.cp = cp
        self.residual_stream = None
        self.extras = {} if extras is None else extras
        self.microbatch = microbatch

        attn_tp = topo.attn_tp
        dp_rank = parallel.attn_dp_rank
        if dp_padding is DpPadding.MAX_LEN:
            longest = max(dp_counts)
            self.slot_rows = -(-longest // attn_tp) * attn_tp
            self.full_rows = self.slot_rows * len(dp_counts)
            self.dp_offset = self.slot_rows * dp_rank
        else:
            self.slot_rows = None
            self.full_rows = sum(dp_counts)
            self.dp_offset = sum(dp_counts[:dp_rank]) if dp_rank else 0
        self.slice_sizes = split_sizes(num_tokens, attn_tp)
        tp_rank = parallel.attn_tp_rank
        self.slice_offset = sum(self.slice_sizes[:tp_rank]) if tp_rank else 0
        # The share of the full rows each TP rank gets from a reduce-scatter under attention DP:
        # DP slot by DP slot, each split over that slot's attention-TP ranks (tp rank order).
        if dp_padding is DpPadding.MAX_LEN:
            self.tp_share_sizes = (self.slot_rows // attn_tp,) * topo.tp if topo.attn_cp == 1 else None
        elif topo.attn_cp == 1:
            self.tp_share_sizes = dp_counts if attn_tp == 1 else tuple(s for c in dp_counts for s in split_sizes(c, attn_tp))
        else:
            self.tp_share_sizes = None

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def describe(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "dp_counts": list(self.dp_counts),
            "dp_padding": self.dp_padding.value,
            "mode": self.mode.value,
            "variant": self.variant.value,
        }

    def child(self, num_tokens: int, *, dp_counts=None, microbatch=None, **overrides) -> "Forward":
        """A Forward for part of this batch (a TBO microbatch, a branch) with its own stream."""
        kwargs = dict(
            dp_padding=self.dp_padding,
            mode=self.mode,
            sequence_parallel=self.variant is BatchVariant.SEQUENCE_PARALLEL,
            input_scattered=self.variant is BatchVariant.INPUT_SCATTERED,
            cp=self.cp,
            extras=dict(self.extras),
            microbatch=microbatch,
        )
        kwargs.update(overrides)
        return Forward(self.parallel, num_tokens, dp_counts=dp_counts, **kwargs)

    def __repr__(self) -> str:
        return f"Forward({self.describe()})"


@attrs.frozen
class ComputeFlags:
    """Flags an open `exit()` scope publishes to the compute inside it.

    - `fuse_mlp_allreduce`: skip the output all-reduce; the boundary owns the sum.
    - `mlp_reduce_scatter`: skip the sum; the boundary reduce-scatters it.
    - `defer_moe_finalize`: a MoE may return a `HandoffOutput` instead of finalizing.
    - `owns_local_tail`: this rank adds a replicated component (LOCAL_TAIL) to its output.
    """

    fuse_mlp_allreduce: bool = False
    mlp_reduce_scatter: bool = False
    defer_moe_finalize: bool = False
    owns_local_tail: bool = True

    @property
    def skips_reduction(self) -> bool:
        return self.fuse_mlp_allreduce or self.mlp_reduce_scatter


_DEFAULT_FLAGS = ComputeFlags()


class _ScopeState(threading.local):
    """What the innermost open exit scope published (`flags`) and the rows the last `prepare()`
    of a stage with row publishers published (`rows`), per thread.

    A thread-local object rather than a `ContextVar`: a compiler's tracer (Dynamo) reads and
    writes its attributes inside a compiled region (the exit scope sets the flags, compute reads
    them, all at trace time) and guards on what it read at a region's start, while a ContextVar
    is opaque to it. Ranks run as threads in the threaded world, so the state must be per
    thread; schedulers that interleave microbatches on one thread (two-batch overlap) check at
    every switch that no scope is open (`exit_scope_open()`)."""

    def __init__(self):  # runs once in each thread, on its first use
        self.flags = _DEFAULT_FLAGS
        self.rows = None

    @contextlib.contextmanager
    def holding(self, name: str, value):
        """Attribute `name` set to `value` for the block, the previous value restored after."""
        previous = getattr(self, name)
        setattr(self, name, value)
        try:
            yield value
        finally:
            setattr(self, name, previous)


_SCOPE = _ScopeState()


def get_forward() -> ComputeFlags:
    """The flags of the innermost open exit scope (defaults when none is open)."""
    return _SCOPE.flags


def exit_scope_open() -> bool:
    """Whether an exit scope (or a `publish_flags` block) is open in this thread.

    Schedulers that interleave work (two-batch overlap) check it where they switch microbatch:
    an open scope would publish one microbatch's flags to the other's compute.
    """
    return _SCOPE.flags is not _DEFAULT_FLAGS


def publish_flags(flags: ComputeFlags) -> ContextManager[ComputeFlags]:
    """Publish flags for the compute inside the block; restore the previous ones after."""
    return _SCOPE.holding("flags", flags)


class RowLayout(enum.Enum):
    """Which token rows a tensor holds: a residual, a compute input or output (each order is
    defined in `_ops`). The one vocabulary of rows: plans, streams and row publishers use it."""

    DP_LOCAL = "dp_local"  #: this rank's attention rows: its attention-DP token set
    DP_GATHERED = "dp_gathered"  #: every DP token set in DP-rank order (MAX_LEN: each padded to slot_rows)
    ATTN_TP_SLICE = "attn_tp_slice"  #: this attention-TP rank's contiguous share of its attention rows
    ATTN_CP_LOCAL = "attn_cp_local"  #: this attention-CP rank's rows of an active CP batch (`Forward.cp`)

    def rows(self, fwd: "Forward") -> int:
        """The number of rows a tensor in this layout has for `fwd` on this rank."""
        if self is RowLayout.DP_GATHERED:
            return fwd.full_rows
        if self is RowLayout.ATTN_TP_SLICE:
            return fwd.slice_sizes[fwd.parallel.attn_tp_rank]
        if self is RowLayout.ATTN_CP_LOCAL:
            return fwd.cp.num_local
        return fwd.num_tokens

    @property
    def phrase(self) -> str:
        """Whose rows, for plans: "this rank's attention-TP slice"."""
        return _PHRASES[self][0]

    @property
    def short(self) -> str:
        """The rows' short name, for plans: "CP rows"."""
        return _PHRASES[self][1]

    def __repr__(self) -> str:
        return self.name


_PHRASES = {
    RowLayout.DP_LOCAL: ("this rank's attention rows", "attention rows"),
    RowLayout.DP_GATHERED: ("every DP rank's rows", "full rows"),
    RowLayout.ATTN_TP_SLICE: ("this rank's attention-TP slice", "attention-TP slices"),
    RowLayout.ATTN_CP_LOCAL: ("this CP rank's rows", "CP rows"),
}


class ComputeRows:
    """What a stage's row adapters published about the rows its compute input holds.

    `published` maps an adapter kind ("lora") to that adapter's per-row facts on exactly these
    rows (for LoRA: which adapter each row uses), so compute that runs on gathered or sliced
    rows reads facts in its own row order instead of the batch's.

    Frozen, compared by identity. A plain class rather than an attrs one: `prepare()` builds it
    inside a compiled region, and Dynamo cannot trace the setattr attrs' frozen `__init__` uses.
    """

    __slots__ = ("stage", "layout", "num_rows", "published")

    stage: str
    layout: RowLayout
    num_rows: int
    published: Mapping[str, Any]

    def __init__(self, *, stage: str, layout: RowLayout, num_rows: int, published: Mapping[str, Any]):
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "num_rows", num_rows)
        object.__setattr__(self, "published", published)

    def __setattr__(self, name, value):
        raise attrs.exceptions.FrozenInstanceError()

    def __delattr__(self, name):
        raise attrs.exceptions.FrozenInstanceError()

    def __repr__(self) -> str:
        return f"ComputeRows(stage={self.stage!r}, layout={self.layout!r}, num_rows={self.num_rows!r}, published={self.published!r})"


def get_compute_rows() -> Optional[ComputeRows]:
    """The rows published by the last `prepare()` of a stage with row adapters (None if none).

    A publication holds until the next one in this thread: run a stage's compute before the
    next stage's `prepare()` (an interleaving scheduler switches between the two, never inside).
    """
    return _SCOPE.rows


def publish_compute_rows(rows: Optional[ComputeRows]) -> None:
    """Publish `rows` for the compute that follows (held until the next publication)."""
    _SCOPE.rows = rows


def scoped_compute_rows(rows: ComputeRows) -> ContextManager[ComputeRows]:
    """Publish `rows` for the block only (compute that runs inside an input move)."""
    return _SCOPE.holding("rows", rows)
