"""Two-batch overlap: run a model's stages as two interleaved microbatches.

The model writes its stages once, as a generator function

    def stages(hidden_states, forward, context):
        for layer in layers:
            hidden_states = layer.attention(hidden_states, forward, context)
            yield                                  # the other microbatch may run here
            hidden_states = layer.ffn(hidden_states, forward)
            yield
        return hidden_states

and `TwoBatchOverlap.run(stages, hidden_states, forward, context=...)` splits the batch, runs one
generator per microbatch (each on its own Forward and residual stream), alternating at every
`yield`, and merges the results. `context(start, stop)` gives a microbatch its compute facts
(positions, request layout) for rows `start:stop` of this rank's attention rows.

Rules checked at every switch, before the other microbatch runs:
- no `exit()` scope is open (its flags would reach the other microbatch's compute; the
  operation-scheduled path computes without one and calls `boundary.postprocess()`);
- the two microbatches hold distinct streams, and nothing uses the parent batch's stream.

Eagerly each microbatch runs in its own `contextvars` context, so a `ContextVar` one sets is
never seen by the other; inside a compiled region (the whole overlapped forward traces as one
graph) both run in the caller's, and the checks above hold the core's state to the same rules.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Callable, Optional

import torch

from layer_boundary import exit_scope_open

from .device import schedule_for
from .messages import Messages
from .microbatch import Microbatch, SplitPlan, check_streams, merge_batch, plan_split, split_batch

__all__ = ["TwoBatchOverlap"]

Stages = Callable[..., Any]


class TwoBatchOverlap:
    """The "tbo" adapter. `streams=True` puts each microbatch on its own CUDA stream on a GPU;
    `ordered=True` starts microbatch 1's operation i after microbatch 0's (see `device`)."""

    def __init__(self, *, streams: bool = True, ordered: bool = True):
        self.streams = streams
        self.ordered = ordered

    # the pieces, for schedulers of their own ------------------------------------------------
    plan = staticmethod(plan_split)
    split = staticmethod(split_batch)
    merge = staticmethod(merge_batch)

    # the whole run ----------------------------------------------------------------------------
    def run(
        self,
        stages: Stages,
        hidden_states,
        forward,
        *,
        context: Optional[Callable[[int, int], Any]] = None,
        split=None,
        streams: Optional[bool] = None,
        ordered: Optional[bool] = None,
    ):
        """Run `stages` over the batch as two interleaved microbatches; returns the merged handle
        (or the concatenated output, when the stages end with the final norm).

        `split`: microbatch 0's rows per attention-DP rank (default: `forward.extras["tbo_split"]`,
        else each rank's token midpoint). When one microbatch would be empty on every rank the
        batch runs whole, through the same checks. `streams` overrides `forward.extras["tbo_streams"]`
        and the adapter's default; `ordered=False` lets microbatch 1's operation i start on its
        stream before microbatch 0's finished (more overlap; only for microbatches that share no
        state, e.g. no request cut between them). Both are local choices: no rank needs to agree.
        """
        if exit_scope_open():
            raise RuntimeError(Messages.NESTED)
        plan: SplitPlan = plan_split(forward, split)
        if not plan.overlapped:
            whole = Microbatch(0, forward, 0, forward.num_tokens, hidden_states)
            (out,) = self._interleave(stages, (whole,), context, schedule_for(None, streams=False))
            return out
        microbatches = split_batch(hidden_states, forward, plan)
        if streams is None:
            streams = forward.extras.get("tbo_streams", self.streams)
        ordered = self.ordered if ordered is None else ordered
        schedule = schedule_for(microbatches[0].hidden, streams=bool(streams), ordered=ordered)
        outputs = self._interleave(stages, microbatches, context, schedule)
        return merge_batch(microbatches, outputs, forward)

    def _interleave(self, stages: Stages, microbatches, context, schedule) -> list:
        contexts = [_Context.new() for _ in microbatches]
        runs = []
        for mb, ctx in zip(microbatches, contexts):
            facts = context(mb.start, mb.stop) if context is not None else None
            run = ctx.run(stages, mb.hidden, mb.forward, facts)
            if not inspect.isgenerator(run):
                raise TypeError(Messages.NOT_GENERATOR.format(got=type(run).__name__))
            runs.append(run)
        outputs: list = [None] * len(runs)
        done = [False] * len(runs)
        schedule.begin()
        try:
            operation = 0
            while not all(done):
                for k, run in enumerate(runs):
                    if done[k]:
                        continue
                    with schedule.step(k, operation):
                        try:
                            contexts[k].run(next, run)
                        except StopIteration as stop:
                            # from `args`: Dynamo gives `.value` as a new tensor object, which the
                            # residual stream's identity check of the handle would then reject
                            outputs[k] = stop.args[0] if stop.args else None
                            done[k] = True
                    self._check_switch(k, microbatches, contexts[k])
                operation += 1
        except BaseException:
            for k, run in enumerate(runs):
                if not done[k]:
                    contexts[k].run(run.close)  # leaves any open exit scope in its own context
            raise
        finally:
            schedule.end()
        return outputs

    @staticmethod
    def _check_switch(index: int, microbatches, ctx) -> None:
        if ctx.run(exit_scope_open):
            raise RuntimeError(Messages.HELD_EXIT.format(index=index))
        if len(microbatches) == 2:
            check_streams(microbatches)


class _Context:
    """A microbatch's `contextvars` context, or none inside a compiled region.

    Eagerly each microbatch runs in a copy of the caller's context, so a `ContextVar` one sets
    (a model's own) is never seen by the other. Dynamo cannot trace a context's `run`, so a
    compiled forward runs both in the caller's: the core's per-forward state is a thread-local
    Dynamo traces, and the switch checks hold it to the same rules either way."""

    __slots__ = ("context",)

    def __init__(self, context):
        self.context = context

    @classmethod
    def new(cls) -> "_Context":
        return cls(None if torch.compiler.is_dynamo_compiling() else contextvars.copy_context())

    def run(self, fn, *args):
        return fn(*args) if self.context is None else self.context.run(fn, *args)
