"""The per-forward residual stream: the residual and the producer's outstanding contribution.

States:
- initial: no residual, nothing pending; the next consumer initialises the residual (`enter`);
- written: a residual, nothing pending; the next consumer reads it without an update;
- pending: a producer's contribution (maybe still owing a sum or a finalize) and its update.

The model keeps the object each boundary call returns (`handle`) and passes exactly that object
to the next call; anything else is rejected, so another microbatch's output or a rebound tensor
never picks up the wrong pending work. The check is by identity: in-place edits are not seen.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._errors import Messages
from .._output import HandoffOutput, OutputTransform, UnreducedOutput

__all__ = ["Contribution", "OwedOutput", "ResidualStream", "ATTENTION_ROWS", "SLICE_ROWS", "CP_ROWS"]

#: where a stream's residual lives: the attention rows, this rank's attention-TP slice of them,
#: or this rank's context-parallel partition of them (an active CP batch; `Forward.cp` maps it)
ATTENTION_ROWS = "attention"
SLICE_ROWS = "slice"
CP_ROWS = "cp"


class Contribution:
    """A producer's output and the work it still owes.

    `value` is the complete tensor, or None while `owed` (an `UnreducedOutput` or a
    `HandoffOutput`) still has to run. `transform` runs once the value is complete.
    """

    __slots__ = ("value", "update", "owed", "transform", "rows")

    def __init__(self, value, update, owed=None, transform: Optional[OutputTransform] = None, rows: str = "attention"):
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
    """Residual and pending contribution of one forward (or one microbatch)."""

    __slots__ = ("residual", "rows", "pending", "handle")

    def __init__(self):
        self.residual = None
        self.rows = ATTENTION_ROWS
        self.pending: Optional[Contribution] = None
        self.handle: Any = None

    # state --------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.pending is not None:
            return "pending"
        return "initial" if self.residual is None else "written"

    def check(self, hidden) -> None:
        if hidden is not self.handle or self.handle is None:
            raise RuntimeError(Messages.FOREIGN_OUTPUT)

    # producer side ------------------------------------------------------------------------
    def record(self, contribution: Contribution):
        """Register a producer's contribution; returns the handle the model keeps."""
        if self.pending is not None:
            raise RuntimeError("cannot replace an unconsumed producer contribution")
        self.pending = contribution
        self.handle = contribution.value if contribution.complete_now else OwedOutput(contribution)
        return self.handle

    def write(self, residual, rows: str = ATTENTION_ROWS, *, handle: Any = None) -> None:
        """Make the stream written (nothing pending); `handle` is what the model passes next."""
        self.pending = None
        self.residual = residual
        self.rows = rows
        self.handle = handle

    # consumer side ------------------------------------------------------------------------
    def take(self, hidden) -> tuple[Optional[Contribution], Any]:
        """(pending contribution or None, residual) for a consumer; checks the handle."""
        self.check(hidden)
        pending = self.pending
        self.pending = None
        self.handle = None
        return pending, self.residual

    def complete(self, hidden) -> torch.Tensor:
        """Complete owed work unfused; the update stays pending on the returned tensor."""
        self.check(hidden)
        if self.pending is None:
            return hidden
        value = self.pending.complete()
        self.handle = value
        return value

    def fold(self, hidden):
        """Complete and apply the pending update; the stream becomes written."""
        self.check(hidden)
        if self.pending is not None:
            contribution = self.pending
            value = contribution.complete()
            if self.residual is None:
                new_residual = value
            else:
                new_residual = contribution.update.apply(value, self.residual)
            self.write(new_residual, self.rows, handle=new_residual)
        return self.handle

    @classmethod
    def arrive(
        cls, hidden, residual, update, *, owed_sum=None, transform=None, rows: str = ATTENTION_ROWS,
        contribution_rows: str = ATTENTION_ROWS,
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
        return f"ResidualStream({self.state}, rows={self.rows})"
