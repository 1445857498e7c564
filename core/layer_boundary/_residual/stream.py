"""The per-forward residual stream: the residual and the producer's outstanding contribution.

States (`StreamState`):
- initial: no residual, nothing pending; the next consumer initialises the residual (`enter`);
- written: a residual, nothing pending; the next consumer reads it without an update;
- pending: a producer's contribution (maybe still owing a sum or a finalize) and its update.

Every consumer (a stage's input, the final norm, a pipeline send, a microbatch split) starts
with the one arrival operation, `receive(handle) -> (state, contribution, residual)`, and
dispatches on the state; `arrive(...)` is its inverse, a stream rebuilt from handed-off parts.

The model keeps the object each boundary call returns (`handle`) and passes exactly that object
to the next call; anything else is rejected, so another microbatch's output or a rebound tensor
never picks up the wrong pending work. The check is by identity: in-place edits are not seen.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from .._errors import Messages
from .._forward import RowLayout
from .._output import HandoffOutput, OutputTransform, UnreducedOutput

__all__ = ["Contribution", "OwedOutput", "ResidualStream", "StreamState", "CARRIED"]

_ATTENTION_ROWS = RowLayout.DP_LOCAL
#: a producer recorded its output while the previous one was still pending
REPLACED_PENDING = "cannot replace an unconsumed producer contribution"


class _Carried:
    """The stream's handle while a parallel-residual FFN runs: the attention's output stays
    pending for that FFN's exit, and no other call can take it (the model never holds this)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CARRIED"


CARRIED = _Carried()
#: a call passed an output on while a parallel-residual FFN held the attention's output
CARRIED_OUTPUT = (
    "a parallel-residual FFN's prepare() took the attention's output to its exit; finish that FFN's exit "
    "(`with boundary.exit(forward) as out: ...; h = out.finish(y)`) and pass on the handle it returns"
)


class StreamState(str, enum.Enum):
    """A stream's state (a `str`, so it also compares equal to "initial", "written", "pending")."""

    INITIAL = "initial"
    WRITTEN = "written"
    PENDING = "pending"

    def __repr__(self) -> str:
        return self.name

    __str__ = str.__str__


class Contribution:
    """A producer's output and the work it still owes.

    `value` is the complete tensor, or None while `owed` (an `UnreducedOutput` or a
    `HandoffOutput`) still has to run. `transform` runs once the value is complete.
    """

    __slots__ = ("value", "update", "owed", "transform", "rows")

    def __init__(self, value, update, owed=None, transform: Optional[OutputTransform] = None, rows: RowLayout = _ATTENTION_ROWS):
        self.value = value
        self.update = update
        self.owed = owed
        self.transform = transform
        self.rows = rows

    @property
    def complete_now(self) -> bool:
        return self.owed is None and self.transform is None

    def complete(self) -> torch.Tensor:
        """Run the owed work unfused and the transform; the update stays for the consumer."""
        if self.owed is not None:
            self.value = self.owed.complete()
            self.owed = None
        if self.transform is not None:
            self.value = self.transform(self.value)
            self.transform = None
        return self.value

    def describe(self) -> str:
        if isinstance(self.owed, UnreducedOutput):
            return repr(self.owed)
        if isinstance(self.owed, HandoffOutput):
            return f"handoff {type(self.owed).__name__}"
        return "complete"


class OwedOutput:
    """The model-facing handle of an output that still owes work.

    It is deliberately not a tensor: arithmetic, slicing or `.shape` on it fail at once, so
    forgetting to complete a sum cannot silently produce a wrong answer. Pass it to the next
    boundary, or to `residual_batch.complete_output()` to get the tensor.
    """

    __slots__ = ("_contribution",)

    def __init__(self, contribution: Contribution):
        object.__setattr__(self, "_contribution", contribution)

    def __getattr__(self, item):
        if item.startswith("__"):  # protocol probes (__dict__, __torch_function__, ...) get Python's answer
            raise AttributeError(item)
        raise TypeError(
            f"an OwedOutput has no {item!r}: it is an unfinished layer output, not a tensor; pass it to the next "
            "boundary, or call residual_batch.complete_output() for the tensor"
        )

    def __setattr__(self, key, value):
        raise TypeError("an OwedOutput is immutable")

    def __bool__(self):
        raise TypeError("an OwedOutput has no truth value; it is an unfinished layer output")

    def __repr__(self) -> str:
        return f"OwedOutput({self._contribution.describe()})"


class ResidualStream:
    """Residual and pending contribution of one forward (or one microbatch).

    `spare` is a complete contribution a lean `prepare()` consumed (its value dropped), which
    the next lean `finish()` refills instead of building one: no constructor frame per layer.
    Only a complete contribution (no owed work, no transform) becomes the spare."""

    __slots__ = ("residual", "rows", "pending", "handle", "spare")

    def __init__(self):
        self.residual = None
        self.rows = _ATTENTION_ROWS
        self.pending: Optional[Contribution] = None
        self.handle: Any = None
        self.spare: Optional[Contribution] = None

    # state --------------------------------------------------------------------------------
    @property
    def state(self) -> StreamState:
        if self.pending is not None:
            return StreamState.PENDING
        return StreamState.INITIAL if self.residual is None else StreamState.WRITTEN

    def check(self, hidden) -> None:
        if hidden is not self.handle or self.handle is None:
            raise RuntimeError(CARRIED_OUTPUT if self.handle is CARRIED else Messages.FOREIGN_OUTPUT)

    # producer side ------------------------------------------------------------------------
    def record(self, contribution: Contribution):
        """Register a producer's contribution; returns the handle the model keeps."""
        if self.pending is not None:
            raise RuntimeError(REPLACED_PENDING)
        self.pending = contribution
        # `complete_now`, inlined (this runs at every producer exit)
        handle = contribution.value if contribution.owed is None and contribution.transform is None else OwedOutput(contribution)
        self.handle = handle
        return handle

    def write(self, residual, rows: RowLayout = _ATTENTION_ROWS, *, handle: Any = None) -> None:
        """Make the stream written (nothing pending); `handle` is what the model passes next."""
        self.pending = None
        self.residual = residual
        self.rows = rows
        self.handle = handle

    # consumer side ------------------------------------------------------------------------
    def receive(self, hidden) -> tuple[StreamState, Optional[Contribution], Any]:
        """The arrival operation: `(state, contribution, residual)` of what reached a consumer.

        A pending contribution is taken (the stream keeps only its residual until the consumer
        writes one); a written stream is left as it is. A contribution on a stream that holds no
        residual (rebuilt from parts without one) has nothing to update: it completes and
        arrives as a written stream, read without an update. Both check that `hidden` is the handle
        the stream gave out; the stack input of an initial stream is not checked.
        """
        pending = self.pending
        if pending is not None:
            self.check(hidden)
            self.pending = self.handle = None
            if self.residual is None:  # nothing to update: the contribution is the residual (as fold() takes it)
                self.residual, self.rows = pending.complete(), pending.rows
                pending.value = None
                return StreamState.WRITTEN, None, self.residual
            return StreamState.PENDING, pending, self.residual
        if self.residual is None:
            return StreamState.INITIAL, None, None
        self.check(hidden)
        return StreamState.WRITTEN, None, self.residual

    def complete(self, hidden) -> torch.Tensor:
        """Complete owed work unfused; the update stays pending on the returned tensor."""
        self.check(hidden)
        if self.pending is None:
            return hidden
        value = self.pending.complete()
        self.handle = value
        return value

    @classmethod
    def arrive(
        cls, hidden, residual, update, *, owed_sum=None, transform=None, rows: RowLayout = _ATTENTION_ROWS,
        contribution_rows: RowLayout = _ATTENTION_ROWS,
    ) -> tuple["ResidualStream", Any]:
        """A stream rebuilt from handed-off parts (pipeline receive, TBO microbatches).

        `hidden` is the producer's contribution (or, when `update` is None, the written
        residual); `owed_sum` is an `UnreducedOutput`-compatible factory for a declared sum the
        receiver still completes, with the producer's `transform` after it; `contribution_rows`
        says which rows it lies on. Returns (stream, handle).
        """
        stream = cls()
        stream.rows = rows
        if update is None:
            stream.write(hidden, rows, handle=hidden)
            return stream, hidden
        stream.residual = residual
        if owed_sum is not None:
            handle = stream.record(Contribution(None, update, owed=owed_sum(hidden), transform=transform, rows=contribution_rows))
        else:
            handle = stream.record(Contribution(hidden, update, rows=contribution_rows))
        return stream, handle

    def __repr__(self) -> str:
        return f"ResidualStream({self.state.value}, rows={self.rows.value})"
